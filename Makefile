# Set-up and the two top-level jobs. Only Python 3.10+ and the system packages are assumed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup kernels demo lint test bench-repack clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel here
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,async,serve,bench]'
	touch $(STAMP)

setup: $(STAMP) kernels

# the native CPU kernels, compiled once ahead of the first run (without a C++ compiler the
# runtime uses its torch paths: this says so and does not fail)
kernels: $(STAMP)
	$(BIN)/python -c "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); \
	from expertfs.runtime import kernels; kernels.load()"

demo: setup
	$(BIN)/expertfs demo

lint: setup
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q

bench-repack: setup
	$(BIN)/python bench/bench_repack.py --sizes 1G,4G,10G --dir $(or $(DIR),.)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
