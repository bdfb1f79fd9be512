# make test | bench | bench-cluster | soak | screenshots   (PYTHON=/path/to/venv/bin/python to pick an interpreter)
PYTHON ?= $(firstword $(wildcard .venv/bin/python) python3)
# Benchmarks written by other parts of the project, run when present.
SCRIPT_BENCHES := context_engine context_cost purge

# The README's first command installs the gateway alone; the tests, the screenshots and the
# benchmarks need extras. Each target says which one is missing rather than failing on an import.
NEEDS_TEST = @$(PYTHON) -c "import pytest, pytest_asyncio, xdist, hypothesis, playwright, pyte" 2>/dev/null || { \
	echo "make $@ needs the test extra: $(PYTHON) -m pip install -e '.[test]'" >&2; \
	echo "(the browser tests also need Chromium and PostgreSQL from Debian: bash .ci/run installs everything)" >&2; \
	exit 2; }
NEEDS_BENCH = @$(PYTHON) -c "import matplotlib, pytest" 2>/dev/null || { \
	echo "make $@ needs the bench and test extras: $(PYTHON) -m pip install -e '.[test,bench]'" >&2; exit 2; }
NEEDS_CHROMIUM = @command -v chromium >/dev/null 2>&1 || test -x /usr/bin/chromium || { \
	echo "make $@ needs Debian's Chromium: apt-get install -y chromium" >&2; exit 2; }

.PHONY: test bench bench-cluster soak screenshots

test:
	$(NEEDS_TEST)
	$(PYTHON) -m pytest -q -n 3 --dist worksteal

# Tables on stdout, JSON and PNG charts under bench/out/; the charts are copied to docs/img/.
bench:
	$(NEEDS_BENCH)
	$(PYTHON) -m bench.gateway_load
	$(PYTHON) -m bench.startup
	$(PYTHON) -m bench.tools
	$(PYTHON) -m bench.streaming
	$(PYTHON) -m bench.memory_timing
	@for name in $(SCRIPT_BENCHES); do \
		if [ -f bench/$$name.py ]; then echo "== bench/$$name.py"; $(PYTHON) bench/$$name.py || exit 1; fi; \
	done
	mkdir -p docs/img
	cp bench/out/gateway_load.png bench/out/startup.png bench/out/tools.png bench/out/streaming.png docs/img/

# Several gateways on one throw-away PostgreSQL against one on SQLite (~3 min; needs PostgreSQL's
# initdb/pg_ctl, or PG_TEST_URL): the table on stdout, bench/out/cluster.{json,png}, the chart to docs/img/.
bench-cluster:
	$(NEEDS_BENCH)
	$(PYTHON) -m bench.cluster
	mkdir -p docs/img
	cp bench/out/cluster.png docs/img/

# Minutes: repeated SIGKILL rounds under load, then a long hypothesis hunt for bad input.
soak:
	$(NEEDS_BENCH)
	$(PYTHON) -m bench.soak

# The web chat's, the admin page's and the approval cards' README screenshots (headless Chromium,
# a gateway on the fakes).
screenshots:
	$(NEEDS_TEST)
	$(NEEDS_CHROMIUM)
	$(PYTHON) -m tests.web_screenshots docs/img
	$(PYTHON) -m tests.admin_screenshot docs/img
	$(PYTHON) -m tests.approval_screenshots docs/img
