# tensorlane: `make demo` and `make test` are the two commands a newcomer needs (run as root).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: bootstrap test test-unit demo report lint clean

bootstrap:
	@scripts/bootstrap $(VENV)

# The linter runs first: `make test` fails on any finding. Then the tests that build no network namespace, on two
# workers (pytest-xdist; a file's tests on one worker, in order: module fixtures are made once); then the netns tests
# of the files marked `concurrent` (no rate, no tight time window: Ansible, agent faults, the shim's registrations),
# two files at a time; then the other netns tests one at a time (their rates and timings must not share the machine's
# two cores). The parts run one after the other: each keeps both cores busy (the concurrent files beside the unit
# tests slowed those by 200 s, 2026-11-28). Every part always runs; pytest's 5 (nothing selected, e.g. PYTEST_ARGS
# naming netns files only) is not a failure.
test: lint
	@rc=0; \
	$(PY) -m pytest -ra --durations=15 -n 2 --dist loadfile -m "not netns" $(PYTEST_ARGS) || [ $$? -eq 5 ] || rc=1; \
	$(PY) -m pytest -ra --durations=15 -n 2 --dist loadfile -m "netns and concurrent" $(PYTEST_ARGS) \
		|| [ $$? -eq 5 ] || rc=1; \
	$(PY) -m pytest -ra --durations=30 -m "netns and not concurrent" $(PYTEST_ARGS) || [ $$? -eq 5 ] || rc=1; \
	exit $$rc

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
