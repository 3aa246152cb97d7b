# FleetBroker: `make demo` and `make test` are the two commands (README).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# SkyPilot (about 100 packages, some pinned below ours) lives in its own venv: the tests check our
# generated tasks with SkyPilot's own parser there, without it in the broker's environment.
SKYPILOT := skypilot==0.14.1
# checkov (Terraform static analysis) pins older boto3 and packaging: its own venv as well.
CHECKOV := checkov==3.3.30

.PHONY: setup test lint docs bench demo chaos clean

setup: $(STAMP)

$(STAMP): pyproject.toml infra/bootstrap.sh
	bash infra/bootstrap.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,test]'
	$(PYTHON) -m venv $(VENV)/skypilot
	$(VENV)/skypilot/bin/python -m pip install -q '$(SKYPILOT)'
	$(PYTHON) -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/python -m pip install -q '$(CHECKOV)'
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check broker policies providers tests examples

# The documentation site, built strictly into a temporary folder: a broken link, a missing page or a
# generated page (HTTP API, CLI, prices, benchmarks) that fails to build fails the target. No -q:
# mkdocs counts warnings for --strict only when they are logged.
docs: setup
	out=$$(mktemp -d) && trap 'rm -rf "$$out"' EXIT && \
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -f docs/mkdocs.yml -d "$$out"

# Two pytest-xdist workers: most cases wait on servers, agents and subprocesses, not the CPU.
test: setup lint docs
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal tests --ignore=tests/bench -m 'not chaos'

# The long fault-and-attack cases (tests/chaos); their fast cases already run in `make test`.
chaos: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/chaos -m chaos

bench: setup
	$(PY) -m tests.bench

demo: setup
	$(VENV)/bin/fleet demo

clean:
	rm -rf $(VENV) build *.egg-info
