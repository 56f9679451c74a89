# make demo: set up, start the services, run the deployment ggpo/offline on the embedded default
# (its stage logs stream here; Ctrl-C cancels the Prefect run, which stops at safe points).
# make test: set up, run the test suite (it starts its own servers on free ports).
# GPU users: make demo TORCH_SPEC="torch" (or any CUDA build) and pip install -e '.[gpu]'.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(abspath $(VENV))/bin
STAMP := $(VENV)/.ggpo-installed

.PHONY: install demo test down

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/ggpo up
	$(BIN)/ggpo run offline --deployment
	$(BIN)/ggpo report

test: install
	$(BIN)/python -m pytest

down:
	$(BIN)/ggpo down
