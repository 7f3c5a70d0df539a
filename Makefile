# moelora_lab: venv, JupyterLab, tests.
#   make                -> same as `make test`
#   make venv           -> .venv/ with the pinned CPU set (requirements-cpu.txt) + this package; without an
#                          NVIDIA GPU, torch's CPU build (scripts/torch_source.py prints which build and why)
#   make lab            -> JupyterLab on notebooks/   (make lab PORT=8890 LAB_ARGS=--no-browser)
#   make test           -> the exercises (solutions pass, stubs fail), then pytest on tests/ and the notebooks (nbval, lax mode)
#   make test-slow      -> what make test leaves out: the exhaustive interpreter sweeps (every rule tile, the property
#                          fuzz, 4 processes) and two long end-to-end runs (the kernels bench pipeline, xdist on a notebook)
#   make test-triton36  -> the kernel tests again under triton 3.6.0 (its own venv, .venv-triton36/)
#   make test-browser   -> every notebook in JupyterLab in headless Chromium: run all, move every explorer's
#                          controls, check what the page shows (installs Debian chromium if missing)
#   make test-wheel     -> build the wheel, install it in a fresh venv outside the checkout, run the README's
#                          example, the exercise list and a notebook against it (scripts/wheel_check.py)
#   make notebooks      -> re-execute every notebook in place (outputs refreshed, volatile metadata dropped)
#   make clean          -> remove the venvs
SHELL := /bin/bash

PYTHON     ?= python3
VENV       ?= .venv
VPY        := $(VENV)/bin/python
STAMP      := $(VENV)/.installed
VENV36     := .venv-triton36

PORT       ?= 8888
LAB_ARGS   ?=
# Jupyter refuses to start as root (containers) without --allow-root.
LAB_ROOT   := $(if $(filter 0,$(shell id -u)),--allow-root)
# Seconds per notebook cell, for `make test` and `make notebooks`.
CELL_TIMEOUT ?= 900
PYTEST_ARGS  ?=
# pytest-xdist workers for `make test` (TEST_WORKERS=0 runs in one process)
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(8, os.cpu_count() or 1))')
PIP        := -m pip install --quiet --quiet --progress-bar off

NOTEBOOKS  := $(wildcard notebooks/*.ipynb notebooks/appendix/*.ipynb)
# the kernel tests that run under the interpreter (the second triton version runs these)
KERNEL_TESTS := tests/test_ops.py tests/test_dispatch.py tests/test_layer.py tests/test_moe.py tests/test_align.py tests/test_validate.py \
                tests/test_paths.py tests/test_streams.py tests/test_properties.py tests/test_compile.py \
                tests/test_exercises.py tests/test_dist.py tests/test_layer_in_k.py tests/test_guarantees.py \
                tests/test_experiments_in_gemm.py tests/test_experiments_in_join.py tests/test_op_grad.py tests/test_layer_grad.py \
                tests/test_quant_gemm.py

# `make test-browser`: Debian's chromium and chromium-driver (apt-get, as root or through sudo; selenium
# comes with the venv); BROWSER_NOTEBOOKS picks notebooks (default: all of notebooks/, the appendix included).
SUDO              := $(if $(filter 0,$(shell id -u)),,sudo)
BROWSER_NOTEBOOKS ?=

.DEFAULT_GOAL := test
.PHONY: venv lab test test-slow test-triton36 test-browser test-wheel notebooks clean check-python

check-python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "moelora_lab needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) --version 2>/dev/null || echo missing). Run e.g. make PYTHON=python3.11"; \
	  exit 1; }

venv: $(STAMP)
	@echo "== $(VENV)/ is ready"
	@echo "   use it:    source $(VENV)/bin/activate    (then python, jupyter lab, pytest; 'deactivate' leaves it)"
	@echo "   or as is:  $(VENV)/bin/python -m moelora_lab.exercises list"
	@echo "   the lab:   make lab    (JupyterLab on notebooks/; open 00_tour.ipynb first)"
	@echo "              make lab PORT=8890 LAB_ARGS=--no-browser    (another port, options to JupyterLab)"
	@echo "   the tests: make test"

# Requirements first, so the loose ranges of pyproject.toml are already met
# and the editable install leaves the CPU torch in place. scripts/torch_source.py prints the extra
# pip arguments for torch's CPU build where they are needed (no GPU, no local +cpu wheel, no PIP_*
# index variable set, PyTorch's CPU index reachable) and one line on which build and why.
$(STAMP): pyproject.toml requirements-cpu.txt | check-python
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@echo "[1/2] $(VENV): the pinned requirements (first run: ~2 min and ~2 GB with a CPU torch)"
	@torch_args=$$($(VPY) scripts/torch_source.py requirements-cpu.txt) && \
	  $(VPY) $(PIP) $$torch_args -r requirements-cpu.txt
	@echo "[2/2] $(VENV): moelora_lab itself (editable)"
	@$(VPY) $(PIP) -e '.[lab,test]'
	@touch $@

lab: $(STAMP)
	env -u MPLBACKEND PATH="$(abspath $(VENV))/bin:$$PATH" \
	  $(VENV)/bin/jupyter lab --notebook-dir=notebooks --port=$(PORT) $(LAB_ROOT) $(LAB_ARGS)

# --nbval-lax only concerns .ipynb files: cells are run and must not raise;
# outputs are compared only for cells marked `# NBVAL_CHECK_OUTPUT`.
# pytest-xdist: one worker per core (at most 8); tests/conftest.py keeps each notebook on one worker.
test: $(STAMP)
	@start=$$SECONDS; \
	echo "== exercises: every solution passes its check, every stub is rejected"; \
	env -u MPLBACKEND $(VPY) -m moelora_lab.exercises check && \
	env -u MPLBACKEND $(VPY) -m moelora_lab.exercises check --stubs && \
	echo "== pytest on tests/ and notebooks/ ($(TEST_WORKERS) workers)" && \
	env -u MPLBACKEND $(VPY) -m pytest tests notebooks -m "not slow" \
	  -n $(TEST_WORKERS) \
	  --nbval-lax --nbval-current-env \
	  --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
	  --nbval-cell-timeout=$(CELL_TIMEOUT) \
	  -p no:cacheprovider $(PYTEST_ARGS); \
	rc=$$?; echo "== make test: $$(( SECONDS - start )) s on $(TEST_WORKERS) workers"; exit $$rc

# the exhaustive interpreter sweeps `make test` leaves out (every distinct tile of the GPU rule, the op's property
# fuzz, the distributed layers on four processes); CI runs them after `make test`
test-slow: $(STAMP)
	@start=$$SECONDS; env -u MPLBACKEND $(VPY) -m pytest tests -m slow -n $(TEST_WORKERS) -p no:cacheprovider $(PYTEST_ARGS); \
	rc=$$?; echo "== make test-slow: $$(( SECONDS - start )) s on $(TEST_WORKERS) workers"; exit $$rc

$(VENV36)/.installed: pyproject.toml requirements-cpu.txt | check-python
	@test -x $(VENV36)/bin/python || $(PYTHON) -m venv $(VENV36)
	@echo "[1/2] $(VENV36): the pinned requirements, then triton 3.6.0 and numpy 2.3.5 in place of the pins"
	@torch_args=$$($(VENV36)/bin/python scripts/torch_source.py requirements-cpu.txt) && \
	  $(VENV36)/bin/python $(PIP) $$torch_args -r requirements-cpu.txt
	@$(VENV36)/bin/python $(PIP) triton==3.6.0 numpy==2.3.5
	@echo "[2/2] $(VENV36): moelora_lab itself (editable)"
	@$(VENV36)/bin/python $(PIP) -e '.[test]'
	@touch $@

test-triton36: $(VENV36)/.installed
	env -u MPLBACKEND $(VENV36)/bin/python -m moelora_lab.exercises check
	env -u MPLBACKEND $(VENV36)/bin/python -m moelora_lab.exercises check --stubs
	env -u MPLBACKEND $(VENV36)/bin/python -m pytest $(KERNEL_TESTS) -n $(TEST_WORKERS) -p no:cacheprovider $(PYTEST_ARGS)

test-browser: $(STAMP)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  echo "test-browser: installing Debian's chromium and chromium-driver"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }
	env -u MPLBACKEND $(VPY) scripts/browser_test.py $(BROWSER_NOTEBOOKS)

# Needs only $(PYTHON) with pip and venv, not .venv/; WHEEL_NOTEBOOK picks the notebook it runs.
WHEEL_NOTEBOOK ?= notebooks/00_tour.ipynb
test-wheel: | check-python
	env -u MPLBACKEND -u PYTHONPATH $(PYTHON) scripts/wheel_check.py --notebook $(WHEEL_NOTEBOOK)

notebooks: $(STAMP)
	@if [ -z "$(NOTEBOOKS)" ]; then echo "no notebooks/*.ipynb"; exit 0; fi
	env -u MPLBACKEND PATH="$(abspath $(VENV))/bin:$$PATH" \
	  $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=$(CELL_TIMEOUT) \
	  --ExecutePreprocessor.kernel_name=python3 \
	  $(NOTEBOOKS)
	$(VPY) scripts/normalize_notebooks.py $(NOTEBOOKS)

clean:
	rm -rf $(VENV) $(VENV36)
