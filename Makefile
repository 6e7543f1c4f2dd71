# Two commands do everything on a fresh machine:
#   make demo   set up, then run the serving engine end to end (CPU: tiny model under the Triton
#               interpreter; GPU: a 1B-class model at real sizes)
#   make test   set up, then run the test suite (CPU: interpreter, small matrix; GPU: compiled, full)
# A torch that is already installed (a CUDA build, the H200 image's) is kept; only when torch is
# missing is the CPU build installed. Everything works offline once the dependencies are present.
PYTHON ?= python3
PIP = $(PYTHON) -m pip --disable-pip-version-check -q
# pytest-xdist: one worker per core (CI: 2), at most 8 on a GPU host
PYTEST_ARGS ?= -n auto --maxprocesses=8

.PHONY: setup test demo bench lint clean

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PIP) install "triton==3.9.0"
	@$(PYTHON) -c "import pytest, hypothesis, xdist" 2>/dev/null || $(PIP) install "pytest>=8" "hypothesis>=6" pytest-xdist
	@$(PYTHON) -c "import safetensors, transformers, tqdm" 2>/dev/null || $(PIP) install safetensors "transformers>=4.53" tqdm
	@$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PIP) install matplotlib
	@$(PYTHON) -m pip show -q pagedflash >/dev/null 2>&1 || $(PIP) install --no-deps --no-build-isolation -e . \
		|| echo "note: editable install failed; running from the source tree"

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

demo: setup
	$(PYTHON) -m pagedflash demo

bench: setup
	$(PYTHON) -m pagedflash bench all

lint:
	$(PYTHON) -m ruff check pagedflash tests tools

clean:
	rm -rf build *.egg-info .pytest_cache bench_results
