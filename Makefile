# make test | bench | bench-cluster | soak | screenshots   (PYTHON=/path/to/venv/bin/python to pick an interpreter)
PYTHON ?= $(firstword $(wildcard .venv/bin/python) python3)
# Benchmarks written by other parts of the project, run when present.
SCRIPT_BENCHES := context_engine context_cost purge

.PHONY: test bench bench-cluster soak screenshots

test:
	$(PYTHON) -m pytest -q -n 3 --dist worksteal

# Tables on stdout, JSON and PNG charts under bench/out/; the charts are copied to docs/img/.
bench:
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
	$(PYTHON) -m bench.cluster
	mkdir -p docs/img
	cp bench/out/cluster.png docs/img/

# Minutes: repeated SIGKILL rounds under load, then a long hypothesis hunt for bad input.
soak:
	$(PYTHON) -m bench.soak

# The web chat's and the admin page's README screenshots (headless Chromium, a gateway on the fakes).
screenshots:
	$(PYTHON) -m tests.web_screenshots docs/img
	$(PYTHON) -m tests.admin_screenshot docs/img
