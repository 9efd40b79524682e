# minillm: two commands set up a fresh machine.
#   make lab    -> installs everything (first time) and launches JupyterLab on notebooks/
#   make test   -> installs everything (first time) and runs the tests
# Both create or reuse the virtual environment in .venv.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.minillm-installed
PYTEST_ARGS ?=

.PHONY: install lab test grade exercises notebooks bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Without CUDA, install the CPU build of torch first, so the unpinned range in
	@# pyproject.toml does not pull a multi-GB CUDA build. With CUDA, keep what pip picks.
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.4"; fi
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

lab: $(STAMP)
	@# JupyterLab's safe defaults: localhost only, token authentication on.
	cd notebooks && ../$(PY) -m jupyter lab --ServerApp.ip=127.0.0.1

test: $(STAMP)
	MINILLM_IMPL=solutions $(PY) -m pytest $(PYTEST_ARGS)

# Grade one exercise against your code in exercises/: make grade EX=01
grade: $(STAMP)
	MINILLM_IMPL=exercises $(PY) -m pytest -m ex$(EX) tests/test_exercises.py

# Regenerate exercises/ from solutions/ (the single source of truth).
exercises: $(STAMP)
	$(PY) scripts/make_exercises.py

# Rebuild the notebooks from their builder scripts (they are committed without outputs).
notebooks: $(STAMP)
	$(PY) scripts/build_notebooks.py
	@test ! -f scripts/build_notebooks_part2.py || $(PY) scripts/build_notebooks_part2.py

# Retrain the shipped Shakespeare model and its draft (about an hour on 2 CPU cores).
train-default-model: $(STAMP)
	$(PY) scripts/train_shakespeare.py

bench: $(STAMP)
	$(PY) -m minillm.bench all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
