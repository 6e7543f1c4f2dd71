# Two commands do everything on a fresh machine:
#   make demo   set up, then run the serving engine end to end (CPU: tiny model under the Triton
#               interpreter; GPU: a 1B-class model at real sizes)
#   make test   set up, then run the test suite (CPU: interpreter, small matrix; GPU: compiled, full)
# A torch that is already installed (a CUDA build, the H200 image's) is kept; only when torch is
# missing is the CPU build installed. The other packages are constraints.txt's versions (DEPS below);
# offline, with the dependencies present, DEPS=installed installs nothing.
PYTHON ?= python3
PIP = $(PYTHON) -m pip --disable-pip-version-check -q
# pytest-xdist: one worker per core (CI: 2), at most 8 on a GPU host; the 25 slowest tests listed at the end
PYTEST_ARGS ?= -n auto --maxprocesses=8 --durations=25
# The CPU builds installed where no torch / triton is present (a CUDA build already there is kept)
TORCH = 2.13.0
TRITON = 3.9.0
EXTRAS = test,engine,bench,serve,structured
# DEPS=pinned: the extras at constraints.txt's versions (what CI passes with; needs the package index)
# DEPS=latest: the newest release of every package constraints.txt names (make test-latest)
# DEPS=installed: keep what imports, install only what is missing, unpinned (offline images, the H200's)
DEPS ?= pinned

.PHONY: setup test test-latest demo bench lint clean

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -c constraints.txt "torch==$(TORCH)"
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PIP) install -c constraints.txt "triton==$(TRITON)"
ifeq ($(DEPS),pinned)
	$(PIP) install -c constraints.txt -e ".[$(EXTRAS)]"
else ifeq ($(DEPS),latest)
	$(PIP) install --upgrade $$(sed -n 's/==.*//p' constraints.txt)
	$(PIP) install -e ".[$(EXTRAS)]"
else ifeq ($(DEPS),installed)
	@$(PYTHON) -c "import pytest, hypothesis, xdist" 2>/dev/null || $(PIP) install pytest hypothesis pytest-xdist
	@$(PYTHON) -c "import safetensors, transformers, tqdm" 2>/dev/null || $(PIP) install safetensors transformers tqdm
	@$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PIP) install matplotlib
	@$(PYTHON) -m pip show -q pagedflash >/dev/null 2>&1 || $(PIP) install --no-deps --no-build-isolation -e . \
		|| echo "note: editable install failed; running from the source tree"
else
	$(error DEPS must be pinned, latest or installed, got '$(DEPS)')
endif

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

test-latest:
	$(MAKE) test DEPS=latest

demo: setup
	$(PYTHON) -m pagedflash demo

bench: setup
	$(PYTHON) -m pagedflash bench all

lint:
	$(PYTHON) -m ruff check pagedflash tests tools

clean:
	rm -rf build *.egg-info .pytest_cache bench_results
