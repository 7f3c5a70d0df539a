# moelora_lab: venv, JupyterLab, tests.
#   make            -> same as `make test`
#   make venv       -> .venv/ with the CPU pins (requirements-cpu.txt) + this package
#   make lab        -> JupyterLab on notebooks/   (make lab PORT=8890 LAB_ARGS=--no-browser)
#   make test       -> pytest on tests/ and the notebooks (nbval, lax mode)
#   make notebooks  -> re-execute every notebook in place (refreshes stored outputs)
#   make clean      -> remove .venv/
SHELL := /bin/bash

PYTHON     ?= python3
VENV       ?= .venv
VPY        := $(VENV)/bin/python
STAMP      := $(VENV)/.installed

PORT       ?= 8888
LAB_ARGS   ?=
# Jupyter refuses to start as root (containers) without --allow-root.
LAB_ROOT   := $(if $(filter 0,$(shell id -u)),--allow-root)
# Seconds per notebook cell, for `make test` and `make notebooks`.
CELL_TIMEOUT ?= 900
PYTEST_ARGS  ?=

NOTEBOOKS  := $(wildcard notebooks/*.ipynb)

.DEFAULT_GOAL := test
.PHONY: venv lab test notebooks clean

venv: $(STAMP)

# Requirements first, so the loose ranges of pyproject.toml are already met
# and the editable install leaves the CPU torch in place.
$(STAMP): pyproject.toml requirements-cpu.txt
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -r requirements-cpu.txt
	$(VPY) -m pip install -e '.[lab,test]'
	@touch $@

lab: $(STAMP)
	env -u MPLBACKEND PATH="$(abspath $(VENV))/bin:$$PATH" \
	  $(VENV)/bin/jupyter lab --notebook-dir=notebooks --port=$(PORT) $(LAB_ROOT) $(LAB_ARGS)

# --nbval-lax only concerns .ipynb files: cells are run and must not raise;
# outputs are compared only for cells marked `# NBVAL_CHECK_OUTPUT`.
test: $(STAMP)
	env -u MPLBACKEND $(VPY) -m pytest tests notebooks \
	  --nbval-lax --nbval-current-env \
	  --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
	  --nbval-cell-timeout=$(CELL_TIMEOUT) \
	  -p no:cacheprovider $(PYTEST_ARGS)

notebooks: $(STAMP)
	@if [ -z "$(NOTEBOOKS)" ]; then echo "no notebooks/*.ipynb"; exit 0; fi
	env -u MPLBACKEND PATH="$(abspath $(VENV))/bin:$$PATH" \
	  $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=$(CELL_TIMEOUT) \
	  --ExecutePreprocessor.kernel_name=python3 \
	  $(NOTEBOOKS)

clean:
	rm -rf $(VENV)
