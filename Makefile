# make demo: set up, start the services, run the deployment ggpo/offline on the embedded default
# (its stage logs stream here; Ctrl-C cancels the Prefect run, which stops at safe points).
# make test: set up, lint, run the test suite (it starts its own servers on free ports).
# make lint: ruff (pyflakes, import order) and mypy (config in pyproject.toml); any finding fails.
# GPU users: make install GPU=1 (torch 2.14.0, the build vLLM 0.33 pins, and the gpu extra), then make demo.
PYTHON ?= python3
VENV ?= .venv
GPU ?= 0
GPU_TORCH_SPEC := torch==2.14.0
ifeq ($(GPU),1)
TORCH_SPEC ?= $(GPU_TORCH_SPEC)
EXTRAS := dev,ray,gpu
else
TORCH_SPEC ?= torch==2.13.0
EXTRAS := dev,ray
endif
BIN := $(abspath $(VENV))/bin
STAMP := $(VENV)/.ggpo-installed-gpu$(GPU)

.PHONY: install demo lint test down

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/ggpo up
	$(BIN)/ggpo run offline --deployment
	$(BIN)/ggpo report

lint: install
	$(BIN)/ruff check pipeline stages flows benchmarks tests
	$(BIN)/mypy --cache-dir .mypy_cache pipeline stages flows benchmarks

test: install lint
	$(BIN)/python -m pytest

down:
	$(BIN)/ggpo down
