# The two commands: `make run` starts the service, `make test` runs the whole test suite.
# Each sets up what it needs first (a virtualenv in .venv with the project and its tools);
# nothing but Python 3.11+ is required, PostgreSQL included (an embedded one is used).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# When this server answers, the tests of what lives in the database run again against it (CI
# machines have one): the schema and its migrations, and the queue's statements (claim, lease,
# recovery, retention, lists, history, cancel and retry) driven in-process. The rest (pages,
# worker and model processes killed and restarted, runners, the CLI, units) does not depend on
# which server answers, and running it twice would double the suite's time: test_durability,
# test_worker and test_end_to_end left this list on 2026-11-27 (about 60 s of the pass's 146 s).
LOCAL_PG := postgresql://postgres@127.0.0.1:5432/test
SERVER_TESTS := tests/test_migrations.py $(addprefix tests/integration/test_,$(addsuffix .py,\
	db api_database sched_claims scheduling retention retention_races batching claim_ahead \
	history scale_lists notify_commits stream sched_outage learned_cap metrics_catchup \
	bulk_cancel api_repeats clocks retention_plans))
# Test processes (pytest-xdist). The suite waits on timers, subprocesses and the database much of
# the time, so three fill a 2-core machine better than two: on a 2-core VM the first pass took
# 409 s with three and 598 s with two, back to back (2026-11-27).
TEST_PROCS ?= 3
# A test that fails is run once more (pytest-rerunfailures), and the summary lists it ("R"): some
# tests bound waits on real processes and timers, which a 2-core VM whose host takes CPU away has
# overrun. A test that fails twice fails the run.
RERUNS ?= 1

.PHONY: setup browser run test lint bench chaos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The app's bytecode is written once here: where PYTHONDONTWRITEBYTECODE is set (as in many
# containers), every worker and warm runner would otherwise compile its sources at each start.
setup: $(STAMP)
	@$(BIN)/python -m compileall -q app

# The browser tests (tests/browser) drive Debian's chromium with Playwright; no browser is ever
# downloaded. Installing it needs apt and root: without them those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing chromium for the browser tests (apt-get install chromium)..."; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
			>/dev/null 2>&1 || echo "no chromium (apt-get failed or not root): the browser tests will skip"; }

run: setup
	$(BIN)/gpujobs serve

test: setup browser
	$(BIN)/python -m pytest -n $(TEST_PROCS) --reruns $(RERUNS)
	@if $(BIN)/python -m tests.pg_answers $(LOCAL_PG); then \
		echo "== the database's tests again, against the PostgreSQL at $(LOCAL_PG) =="; \
		DATABASE_URL=$(LOCAL_PG) $(BIN)/python -m pytest -n $(TEST_PROCS) --reruns $(RERUNS) $(SERVER_TESTS); \
	else echo "(no second pass, for the reason above: the embedded server was the only one tested)"; fi

lint: setup
	$(BIN)/ruff check app tests
	$(BIN)/ruff format --check app tests
	$(BIN)/mypy app

bench: setup
	$(BIN)/python -m tests.bench.bench_queue

chaos: setup
	$(BIN)/python -m tests.bench.chaos

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
