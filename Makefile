# The two commands that matter: `make run` and `make test` (each sets up what is missing first).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-test run test bench clean

setup:
	@scripts/setup.sh

setup-test:
	@QOSAGENT_SETUP_TEST=1 scripts/setup.sh

run: setup
	$(PY) -m qosagent run $(ARGS)

test: setup-test
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup-test
	$(PY) -m bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
