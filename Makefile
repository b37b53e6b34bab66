# aios-blocks: `make demo` and `make test` work on a fresh machine (they create .venv first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: wheel-check install demo test unit integration lint bench bench-quick bench-peer trace-bench chaos soak clean up mutate

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/blocks demo --data-dir .aios-demo

up: $(STAMP)
	$(BIN)/blocks up

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q -ra

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/pytest -q -ra tests/integration

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# the reliability harness at the issue's sizes (1,000 blocks under SIGKILL, 10,000 bad messages,
# 1,000 random virtual-cluster operations on real servers);
# `make test` runs the same scenarios at CI size
chaos: $(STAMP)
	AIOS_CHAOS_SCALE=large $(BIN)/pytest -q -ra -s --timeout 3600 tests/chaos \
		tests/integration/test_vcluster.py::test_random_operations_on_real_servers_keep_every_node_in_one_place

# the soak (docs/reliability.md "Partitions and failovers"): 3 NATS servers behind cuttable links and
# a Redis Cluster, mixed creates/scales/deletes/tasks at half the measured peak rate with random
# faults, the invariants checked every minute; not in `make test`. SOAK_ARGS: e.g. "--minutes 5 --seed 2"
SOAK_MINUTES ?= 30
soak: $(STAMP)
	$(BIN)/python -m tests.chaos.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

bench-quick: $(STAMP)
	$(BIN)/python -m bench.run_all --quick

# the GPU trace replay against the FGD paper's published means (docs/trace.md); not in `make test`.
# TRACE_ARGS: e.g. "--policies fgd,best-fit --seeds 42,43 --traces DIR --workloads default,gpushare40"
trace-bench: $(STAMP)
	$(BIN)/python -m bench.trace_replay $(TRACE_ARGS)

# Ray side by side: the uniform peer rows, then the GPU trace's live placement against Ray placement
# groups (docs/trace.md "Live vs Ray"); PEER_ARGS: e.g. "--tasks 500 --lat 100 --sample-nodes 100"
bench-peer: $(STAMP)
	$(BIN)/pip install -q "ray>=2.9"
	$(BIN)/python -m bench.run_all --only peer
	$(BIN)/python -m bench.trace_vs_ray $(PEER_ARGS)

# mutation score of the modules whose decisions users rely on (docs/testing.md); not in `make test`.
# MUTATE_ARGS: e.g. "-m capacity --survivors"
mutate: $(STAMP)
	$(BIN)/python tools/mutate.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) .aios-data .aios-demo .pytest_cache

# the built wheel installed into a fresh venv: CLI, node agent and every module import (CI runs it)
wheel-check:
	bash .ci/wheel-check
