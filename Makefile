# Two commands do everything on a clean clone with Python 3.11 and make:
#   make figures   # install, then run every notebook on the default model (regenerates figures/ and results)
#   make test      # install, then the whole test suite (real model tests included)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hqlab-installed

.PHONY: setup test test-fast figures notebooks site bench clean-venv arctic

# requirements-vllm.txt: the vllm extra without vLLM's CUDA dependencies (its configs and CPU-side proposers run on
# any machine; tests/test_vllm_adapter.py drives them).
$(STAMP): requirements.txt requirements-vllm.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-vllm.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

figures: setup
	$(BIN)/hqlab figures

# Paired .ipynb files for opening in JupyterLab (the .py files are the source of truth).
notebooks: setup
	$(BIN)/jupytext --to ipynb notebooks/*.py

# The executed notebooks (make figures) and docs/ as an HTML site that works offline: site/index.html.
site: setup
	$(BIN)/hqlab site

# Optional extra: Arctic Inference's suffix tree (proposer arctic-suffix), built from source in a side venv.
ARCTIC_BUILD := $(VENV)/arctic-build
arctic: setup
	$(PYTHON) -m venv $(ARCTIC_BUILD)
	$(ARCTIC_BUILD)/bin/python -m pip install --quiet -r requirements-arctic.txt
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$$($(ARCTIC_BUILD)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/project.pth"
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(ARCTIC_BUILD))/bin/python3" $(ARCTIC_BUILD)/bin/python -m pip wheel --quiet --no-deps --no-build-isolation arctic-inference==0.3.0 -w $(ARCTIC_BUILD)/wheels
	$(BIN)/python -m pip install --quiet --no-deps $(ARCTIC_BUILD)/wheels/arctic_inference-0.3.0-*.whl

clean-venv:
	rm -rf $(VENV)
