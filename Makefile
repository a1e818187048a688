# Two commands do all the set-up on a fresh machine (python3 with pip and venv):
#   make reproduce   every study at its default parameters, then the site
#   make test        the whole test suite
# Set-up (.venv + the locked packages of requirements-lock.txt + editable attnum) runs only when
# requirements-lock.txt, requirements.txt or pyproject.toml changed since the last install.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PARAMS ?= default
STUDY ?= length_scaling
GRID ?=
NAME ?=

.PHONY: setup reproduce test lab sweep publish bench clean clean-results distclean

# nbstripout as a git filter (.gitattributes): notebooks saved with outputs in JupyterLab are committed
# without them; --keep-id keeps the cell ids, so the filter leaves committed notebooks byte for byte.
setup: $(STAMP)
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
	    $(VENV)/bin/nbstripout --install --attributes .gitattributes && \
	    git config filter.nbstripout.clean '"$(abspath $(PY))" -m nbstripout --keep-id' && \
	    echo "nbstripout: git filter installed (committed notebooks stay output-free)"; \
	else echo "not a git checkout: nbstripout filter not installed"; fi

# The lock (requirements-lock.txt: every package at its exact version, transitive ones included; its torch is
# the CPU build, torch==2.13.0+cpu) is what gets installed. pip takes torch from wherever it is configured to
# look (a CI machine's local wheel); where that has no +cpu build (PyPI has none), the install is repeated
# with PyTorch's CPU index added (TORCH_INDEX), so a CPU-only machine never downloads the CUDA build's
# nvidia-* libraries. pip itself is left at the venv's version: the lock does not need a newer one.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
$(STAMP): requirements-lock.txt requirements.txt pyproject.toml
	@# a venv whose creation was interrupted (no pip in it) is made again, not used
	@$(PY) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv --clear $(VENV)
	@$(PY) -m pip install --quiet -r requirements-lock.txt || { \
	    echo "retrying with PyTorch's CPU index ($(TORCH_INDEX)) for torch==2.13.0+cpu"; \
	    $(PY) -m pip install --quiet -r requirements-lock.txt --extra-index-url $(TORCH_INDEX); }
	$(PY) -m pip install --quiet --no-deps -e .
	@touch $@

# one Dask task per study, longest first: WORKERS=N worker processes (default: the cores, 2 here), THREADS=N
# threads per run (default 1), GPUS=N pinned GPU workers, ATTNUM_DASK_SCHEDULER=tcp://host:8786 an existing
# cluster (README: Batches on Dask)
BATCH_OPTS = $(if $(WORKERS),--workers $(WORKERS)) $(if $(THREADS),--threads $(THREADS)) $(if $(GPUS),--gpus $(GPUS))
reproduce: $(STAMP)
	$(PY) -m attnum run-all --params $(PARAMS) $(BATCH_OPTS)
	$(PY) -m attnum publish

# the import layers first (pyproject.toml [tool.importlinter]; no cache folder left behind), then the tests
test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

# JupyterLab at the project root (outputs/ and outputs/site/ one click away), opened on notebooks/;
# it refuses root unless told (containers often run as root).
lab: setup
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks $(if $(filter 0,$(shell id -u)),--allow-root,) $(LAB_ARGS)

sweep: $(STAMP)
	@test -n "$(GRID)" || { echo "usage: make sweep STUDY=length_scaling GRID='head_dim=32,64' [PARAMS=default] [NAME=hd] [WORKERS=2] [THREADS=1] [GPUS=0]"; exit 2; }
	$(PY) -m attnum sweep $(STUDY) --params $(PARAMS) --grid '$(GRID)' $(if $(NAME),--name '$(NAME)') $(BATCH_OPTS)

# the site: Sphinx + MyST-NB renders the executed notebooks (never re-runs them) into outputs/site/
publish: $(STAMP)
	$(PY) -m attnum publish

bench: $(STAMP)
	$(PY) -m attnum bench

# Removes caches, the rendered site and leftovers of interrupted runs; never results, never a live run
# (attnum.runs.clean: a run is live while it holds its lock or its owner process is alive).
clean:
	@if [ -x $(PY) ]; then $(PY) -m attnum clean; else echo "no $(PY): outputs/ left as it is (make setup)"; fi
	rm -rf .pytest_cache build lib/*.egg-info
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +

# Deletes every study result not tracked by git: only when asked explicitly, and not while a run is live.
clean-results:
	@test "$(CONFIRM)" = yes || { echo "refusing: run 'make clean-results CONFIRM=yes' to delete outputs/*"; exit 2; }
	$(PY) -m attnum clean-results --yes --outputs outputs

distclean: clean
	rm -rf $(VENV)
