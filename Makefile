# One command to serve, one to test; both build their own virtual environment.
# torch is installed first and alone: TORCH=torch==2.13.0 is the CPU build here; on a
# GPU host pass the CUDA build, e.g.
#   make serve TORCH="torch --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?= test
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvserve-installed

.PHONY: install serve test test-fast clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[$(EXTRAS)]'
	touch $@

# Serves the embedded default model (SmolLM2-135M-Instruct) on http://127.0.0.1:8000.
# Flags: make serve ARGS="--port 9000 --dtype bfloat16"
serve: $(STAMP)
	$(BIN)/kvserve serve $(ARGS)

# The whole suite (CI runs exactly this).
test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

# Without the tests that load the default model.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
