# `make demo` and `make test` do all set-up themselves on a fresh machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.agora-installed
PYTEST_ARGS ?=

.PHONY: setup lint test demo clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[node,dev]'
	$(VENV)/bin/pip check
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/agora demo

clean:
	rm -rf $(VENV) demo-out .mypy_cache .ruff_cache .pytest_cache
