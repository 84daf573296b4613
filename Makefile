# One command to serve, one to test; both build their own virtual environment.
# torch is installed first and alone: TORCH=torch==2.13.0 is the CPU build here; on a
# GPU host pass the CUDA build and the gpu extra, e.g.
#   make serve TORCH="torch --index-url https://download.pytorch.org/whl/cu128" EXTRAS=gpu
# `make serve` installs what serving needs; `make test` adds the test extra.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?=
BIN := $(VENV)/bin
TORCH_STAMP := $(VENV)/.torch-installed
SERVE_STAMP := $(VENV)/.kvserve-installed
TEST_STAMP := $(VENV)/.kvserve-test-installed
comma := ,
serve_extras := $(if $(EXTRAS),[$(EXTRAS)])
test_extras := [test$(if $(EXTRAS),$(comma)$(EXTRAS))]

.PHONY: install install-test serve test test-fast gpu-dry-run clean

install: $(SERVE_STAMP)
install-test: $(TEST_STAMP)

$(TORCH_STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install $(TORCH)
	touch $@

$(SERVE_STAMP): pyproject.toml $(TORCH_STAMP)
	$(BIN)/pip install -e '.$(serve_extras)'
	touch $@

$(TEST_STAMP): pyproject.toml $(TORCH_STAMP)
	$(BIN)/pip install -e '.$(test_extras)'
	touch $@

# Serves the embedded default model (SmolLM2-135M-Instruct) on http://127.0.0.1:8000.
# Flags: make serve ARGS="--port 9000 --dtype bfloat16"
serve: $(SERVE_STAMP)
	$(BIN)/kvserve serve $(ARGS)

# The whole suite (CI runs exactly this), on one pytest-xdist worker per core; each
# test file stays on one worker, so its module-scoped servers start once.
# TEST_WORKERS=0 runs it in this process alone. The 30 slowest tests are listed at the
# end, so a CI log shows where the suite's time goes.
TEST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30
test: $(TEST_STAMP)
	$(PYTEST) $(ARGS)

# Without the tests that load the default model.
test-fast: $(TEST_STAMP)
	$(PYTEST) -m "not slow" $(ARGS)

# bench/gpu_session.sh (a lent GPU's one call) on this CPU: every stage with tiny
# shapes, importing as the GPU image would; fails if any stage does not end ok.
gpu-dry-run: $(TEST_STAMP)
	KVSERVE_GPU_DRY_RUN=1 PYTHON=$(BIN)/python OUT=$(or $(OUT),/tmp/kvserve-gpu-dry-run) \
		bash bench/gpu_session.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
