# FleetBroker: `make demo` and `make test` are the two commands (README).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# SkyPilot (about 100 packages, some pinned below ours) lives in its own venv: the tests check our
# generated tasks with SkyPilot's own parser there, without it in the broker's environment.
SKYPILOT := skypilot==0.14.1

.PHONY: setup test lint bench demo chaos clean

setup: $(STAMP)

$(STAMP): pyproject.toml infra/bootstrap.sh
	bash infra/bootstrap.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,test]'
	$(PYTHON) -m venv $(VENV)/skypilot
	$(VENV)/skypilot/bin/python -m pip install -q '$(SKYPILOT)'
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check broker policies providers tests examples

test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider tests --ignore=tests/bench -m 'not chaos'

# The long fault-and-attack cases (tests/chaos); their fast cases already run in `make test`.
chaos: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/chaos -m chaos

bench: setup
	$(PY) -m tests.bench

demo: setup
	$(VENV)/bin/fleet demo

clean:
	rm -rf $(VENV) build *.egg-info
