# search-proxy: `make run` serves config.yaml on 127.0.0.1:8080; `make test` sets up and runs the suite;
# `make demo` serves a demo with fake vendors, no keys needed
# (`make test TIER=unit`: one tier, unit|integration|e2e|deploy, see tests/conftest.py).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUM    := $(shell cksum pyproject.toml | cut -d' ' -f1)
RUN_STAMP  := $(VENV)/.run-$(SUM)
TEST_STAMP := $(VENV)/.test-$(SUM)
CONFIG ?= config.yaml
TIER   ?=
# The official TypeScript MCP SDK the suite drives agents with (tests/test_mcp_ts_client.py).
MCP_TS_SDK := 1.32.2
TS_SDK_STAMP := $(VENV)/node_modules/@modelcontextprotocol/sdk/package.json

.PHONY: run demo test lint format bench venv redis-server curl deploy-tools browser ts-sdk \
	check-config clean

# `make run PORT=9000 ADMIN_PORT=9001 HOST=0.0.0.0 CONFIG=other.yaml`, each optional: HOST, PORT
# and ADMIN_PORT override the config's server section (a second instance needs both ports).
# `:=` ignores them in the environment; the command line wins.
HOST :=
PORT :=
ADMIN_PORT :=
LISTEN = $(if $(HOST), --host $(HOST))$(if $(PORT), --port $(PORT))$(if $(ADMIN_PORT), --admin-port $(ADMIN_PORT))
run: $(RUN_STAMP)
	$(BIN)/search-proxy --config $(CONFIG)$(LISTEN)

# The proxy on proxy/testing/demo.yaml with a fake vendor behind each route: no keys, no network;
# in the foreground, Ctrl-C stops it all. PORT, ADMIN_PORT and HOST as for `make run`.
demo: $(RUN_STAMP)
	$(BIN)/python -m proxy.testing.demo$(LISTEN)

# Only the deploy tier (or the whole suite) needs promtool, prometheus and docker-compose; only
# the e2e tier (or the whole suite) a browser, node and the TypeScript MCP SDK.
test: $(TEST_STAMP) redis-server curl $(if $(filter-out deploy,$(TIER)),,deploy-tools) \
		$(if $(filter-out e2e,$(TIER)),,browser ts-sdk)
	$(BIN)/pytest -q $(if $(TIER),-m $(TIER)) $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	PYTHONPATH=$(VENV)/lint $(BIN)/python -c 'import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())'

format: $(TEST_STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# `make bench` runs every group; `make bench core` (or any groups after `bench`) runs those.
BENCH_GROUPS := $(if $(filter bench,$(MAKECMDGOALS)),$(filter-out bench,$(MAKECMDGOALS)))
bench: $(TEST_STAMP) redis-server
	@command -v wrk >/dev/null || sh scripts/ensure-package.sh wrk wrk
	$(BIN)/python -m bench $(BENCH_GROUPS)

# The group names after `bench` are its arguments, not targets of their own.
ifneq ($(BENCH_GROUPS),)
$(BENCH_GROUPS):
	@:
endif

check-config: $(RUN_STAMP)
	$(BIN)/search-proxy check-config $(CONFIG)

venv: $(TEST_STAMP)

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) || { echo "cannot create a venv: install python3-venv (apt-get install python3-venv)"; exit 1; }
	$(BIN)/pip install -q --upgrade pip

# `make run` installs what serving needs; `make test` adds the test, lint and SDK packages.
$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	@rm -f $(VENV)/.run-*
	@touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	@# The mcp SDK's 2.x line, on its own path: tests/test_mcp2_client.py runs an agent on it
	@# (the project pins mcp<2).
	$(BIN)/pip install -q --no-warn-conflicts --upgrade --target $(VENV)/mcp2 'mcp>=2,<3'
	@# import-linter (make lint: policies/ never imports proxy/) on its own path too: it brings
	@# rich, which structlog imports whenever it is installed, and every proxy started from this
	@# venv (make run, the suite, make bench) then held 8 MB that the image's proxy does not.
	$(BIN)/pip install -q --no-warn-conflicts --upgrade --target $(VENV)/lint 'import-linter>=2.16'
	@rm -f $(VENV)/.test-* $(VENV)/.run-*
	@touch $@ $(RUN_STAMP)

# redis-server brings redis-cli (topologies are built with it); openssl makes the TLS tests' CA.
redis-server:
	@sh scripts/ensure-package.sh redis-server redis-server
	@sh scripts/ensure-package.sh redis-cli redis-tools
	@sh scripts/ensure-package.sh openssl openssl

# The README's tour and docs/ show curl commands; tests/test_tour.py and test_docs.py run them.
curl:
	@sh scripts/ensure-package.sh curl curl

# promtool checks the alert rules and prometheus runs the dashboard's queries (one Debian
# package); docker-compose checks the compose file (no engine needed).
deploy-tools:
	@sh scripts/ensure-package.sh promtool prometheus
	@sh scripts/ensure-package.sh prometheus prometheus
	@sh scripts/ensure-package.sh docker-compose docker-compose

# tests/test_status_page.py opens the admin listener's status page in a headless Chromium.
browser:
	@sh scripts/ensure-package.sh chromium chromium

# node from Debian's package when missing; the SDK from npm into .venv/node_modules, only when
# it is missing or another version (testkit/mcpts.mjs loads it from there).
ts-sdk:
	@sh scripts/ensure-package.sh node nodejs
	@sh scripts/ensure-package.sh npm npm
	@grep -qs '"version": "$(MCP_TS_SDK)"' $(TS_SDK_STAMP) || \
		npm install --prefix $(VENV) --no-save --no-audit --no-fund --loglevel=error \
			@modelcontextprotocol/sdk@$(MCP_TS_SDK)

clean:
	rm -rf $(VENV) build *.egg-info
