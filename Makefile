# tensorlane: `make demo` and `make test` are the two commands a newcomer needs (run as root).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: bootstrap test test-unit demo report lint clean

bootstrap:
	@scripts/bootstrap $(VENV)

# The linter runs first: `make test` fails on any finding.
test: lint
	$(PY) -m pytest -ra --durations=30 $(PYTEST_ARGS)

test-unit: bootstrap
	$(PY) -m pytest -ra -m "not netns" $(PYTEST_ARGS)

demo: bootstrap
	$(VENV)/bin/python -m bench.demo --json demo.json

# results/README.md (the results page), the README's headline block and docs/img/bench-*.png from results/*.json
report: bootstrap
	$(PY) -m bench.report

lint: bootstrap
	$(VENV)/bin/ruff check .

clean:
	-$(VENV)/bin/python -m testbed down --all 2>/dev/null
	rm -rf $(VENV) .pytest_cache build *.egg-info
