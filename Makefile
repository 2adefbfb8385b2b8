# The two commands that matter: `make run` and `make test` (each sets up what is missing first).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-test run test lint bench clean

setup:
	@scripts/setup.sh

setup-test:
	@QOSAGENT_SETUP_TEST=1 scripts/setup.sh

run: setup
	$(PY) -m qosagent run $(ARGS)

test: setup-test lint
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup-test
	$(VENV)/bin/ruff check .

# Each benchmark prints its measurements (ratios against a baseline taken in the same run) for docs/PERFORMANCE.md.
bench: setup-test
	$(PY) -m bench.latency_overhead
	$(PY) bench/quota_bench.py
	$(PY) -m bench.dvfs_collect
	$(PY) bench/placement_bench.py
	$(PY) -m bench.admission_decide

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
