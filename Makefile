# tensorlane: `make demo` and `make test` are the two commands a newcomer needs (run as root).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: bootstrap test test-unit demo report lint clean

bootstrap:
	@scripts/bootstrap $(VENV)

# The linter runs first: `make test` fails on any finding. Then scripts/test: the tests that build no network
# namespace (two workers, pytest-xdist; a file's tests on one worker, in order: module fixtures are made once) in the
# background under SCHED_IDLE, while the netns tests whose rates and timings need the CPU run one at a time in the
# foreground (they leave two thirds of the two cores idle, which the unit tests fill); then the netns tests of the
# files marked `concurrent` (no rate, no tight time window: Ansible, agent faults, the shim's registrations), two
# files at a time. Every part always runs; its exit status is 1 if any failed.
test: lint
	@scripts/test $(PY) $(PYTEST_ARGS)

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
