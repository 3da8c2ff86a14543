# dsh-pipeline: the two commands that matter are `make demo` and `make test`; `make check` is
# the contributors' quick one (lint and the unit tier: no broker, registry, Java or browser).
# Everything installs itself when missing: the virtualenv (.venv) with the product (pipeline/)
# and the development package (dev/: the local stack, the chaos campaign, the broker, demo,
# chaos and bench commands), and the Java artifacts (Kafka, Apicurio Registry from Maven
# Central into the cache).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dsh-installed
PYTEST_ARGS ?= --durations=15 --timeout=900
# The unit tier: the tests that need no broker, registry, cluster, Java artifacts, browser,
# promtool or MCP servers (the markers: pyproject.toml; tests/conftest.py marks by fixture, and
# fails a test that runs Java without saying so).
UNIT_MARKERS := not broker and not registry and not cluster and not jars and not browser \
	and not promtool and not mcp
UNIT_ARGS ?= --durations=10 --timeout=300
# The cache of downloaded tools (Java artifacts, Toxiproxy, MCP servers, chaos runs): the
# checkout's .cache/ for everything make runs, unless DSH_CACHE_DIR is set (without make the
# commands default to ~/.cache/dsh-pipeline: pipeline.settings.cache_dir).
export DSH_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: setup artifacts tools test lint pytest check unit demo broker chromium promtool bench \
	constraints docs toxiproxy chaos mcp-servers

setup: $(STAMP) artifacts

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-run the (idempotent) editable installs of the product and the development package (dev/)
# when a pyproject.toml changes, or the compiled decoder's source (setup.py builds it;
# pipeline/codec/binary_native.py).
$(STAMP): pyproject.toml dev/pyproject.toml constraints.txt setup.py \
		pipeline/codec/_native_events.pyx | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,rocksdb]' -e ./dev
	touch $(STAMP)

# Pins what the virtualenv holds now as the exact versions `make` and CI install.
constraints: $(STAMP)
	{ sed -n '1,2p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

artifacts: $(STAMP)
	$(BIN)/dsh-pipeline broker --fetch-only --secure

tools: $(STAMP)
	$(BIN)/dsh-pipeline broker --fetch-only --with-tools --secure

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The whole suite, in two lanes at once (tests/run_lanes.sh says why and how): the tests marked
# `long` (the short chaos campaign, the quick benchmark suite) beside all the others. To run a
# part of the suite, call .venv/bin/pytest yourself.
pytest: setup
	tests/run_lanes.sh $(BIN)/pytest $(PYTEST_ARGS)

# The unit tier alone: no Java artifacts, no broker (setup's `artifacts` is not needed).
unit: $(STAMP)
	tests/run_unit.sh $(BIN)/pytest -m "$(UNIT_MARKERS)" $(UNIT_ARGS)

# For contributors, before a commit: ruff, mypy, import layers, then the unit tier (two pytest
# processes at once: tests/run_unit.sh). `make test` runs everything, as CI does.
check: $(STAMP)
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory unit

# Debian's chromium for the dashboard's browser tests (Playwright drives it; no browser download).
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
	    sudo_=""; [ "$$(id -u)" = 0 ] || sudo_=sudo; \
	    $$sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo_ apt-get install -y -qq chromium; \
	fi

# Debian's promtool (package prometheus) checks and unit-tests deploy/grafana's alert rules and
# scrape configs (tests/deploy/test_grafana.py). Its service is not started.
promtool:
	@if ! command -v promtool >/dev/null; then \
	    sudo_=""; [ "$$(id -u)" = 0 ] || sudo_=sudo; \
	    $$sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo_ apt-get install -y -qq --no-install-recommends prometheus; \
	fi

test: setup chromium promtool toxiproxy mcp-servers
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory pytest

demo: setup
	$(BIN)/dsh-pipeline demo

broker: setup
	$(BIN)/dsh-pipeline broker

# The benchmark suite (bench/suite.py): rewrites BENCHMARKS.md; BENCH_ARGS=--quick for a short run.
# Its figures (JSON lines) go to bench-figures.jsonl; a full run also recomputes
# deploy/CAPACITY.md from them (bench/capacity.py).
bench: setup
	$(BIN)/dsh-pipeline bench $(BENCH_ARGS) > bench-figures.jsonl || (cat bench-figures.jsonl; exit 1)
	cat bench-figures.jsonl
	case "$(BENCH_ARGS)" in *--quick*) ;; *) $(BIN)/python bench/capacity.py \
	  --figures bench-figures.jsonl --output deploy/CAPACITY.md --print-figures ;; esac

# The docs' generated blocks (settings reference, exit codes) rewritten from the code.
docs: $(STAMP)
	$(BIN)/python bench/regenerate_docs.py

# Toxiproxy for `make chaos` (network faults), pinned: `@latest` resolves to the old v2.5.0.
# Installed once into the cache ($DSH_CACHE_DIR); a present binary is kept.
TOXIPROXY_VERSION := 2.12.0
TOXIPROXY_DIR = $(DSH_CACHE_DIR)/toxiproxy-$(TOXIPROXY_VERSION)
toxiproxy:
	@if [ ! -x "$(TOXIPROXY_DIR)/server" ]; then \
	    mkdir -p "$(TOXIPROXY_DIR)" && \
	    GOBIN="$(TOXIPROXY_DIR)" go install github.com/Shopify/toxiproxy/v2/cmd/server@v$(TOXIPROXY_VERSION); \
	fi
	@echo "toxiproxy: $(TOXIPROXY_DIR)/server"

# The chaos campaign (docs/chaos.md): about 15 minutes; CHAOS_ARGS e.g. --seed 7 --minutes 5.
chaos: setup toxiproxy
	$(BIN)/dsh-pipeline chaos --toxiproxy "$(TOXIPROXY_DIR)/server" $(CHAOS_ARGS)

# The third-party MCP servers the tests and benchmarks run (tests/mcp_servers/): the npm ones
# (server-everything, server-filesystem) by `npm ci` from the committed lock file, and
# mcp-server-git (PyPI) in a virtualenv of its own, since its dependencies are not the
# pipeline's. Installed into the cache ($DSH_CACHE_DIR or .cache/); redone when a pin changes.
# Needs node and npm; tests/support/mcp_support.py finds them there.
MCP_SERVERS_DIR = $(or $(DSH_CACHE_DIR),$(CURDIR)/.cache)/mcp-servers
MCP_SERVER_GIT_VERSION := 2026.10.19
mcp-servers: $(MCP_SERVERS_DIR)/.installed
$(MCP_SERVERS_DIR)/.installed: tests/mcp_servers/package.json tests/mcp_servers/package-lock.json \
		tests/mcp_servers/git-constraints.txt
	mkdir -p "$(MCP_SERVERS_DIR)"
	cp tests/mcp_servers/package.json tests/mcp_servers/package-lock.json "$(MCP_SERVERS_DIR)/"
	cd "$(MCP_SERVERS_DIR)" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	[ -x "$(MCP_SERVERS_DIR)/git-venv/bin/python" ] || $(PYTHON) -m venv "$(MCP_SERVERS_DIR)/git-venv"
	"$(MCP_SERVERS_DIR)/git-venv/bin/python" -m pip install --quiet \
	    -c tests/mcp_servers/git-constraints.txt mcp-server-git==$(MCP_SERVER_GIT_VERSION)
	touch "$@"
