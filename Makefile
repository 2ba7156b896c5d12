# omnireduce: `make test` and `make demo` work on a fresh machine (they create .venv themselves).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
NET ?=

.PHONY: test lint venv clean bench demo soak exit-loop containers

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q

soak: $(STAMP)
	$(PY) -m pytest -q -s -m slow tests/test_soak.py

# The README's script under torchrun, 100 times per layout (one node, two nodes, fused optimizer):
# every run exits 0, prints no warning, leaves nothing running (~35 minutes; not part of make test)
exit-loop: $(STAMP)
	$(PY) -m pytest -q -m slow tests/test_clean_exit.py

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	touch $(BENCH_STAMP)

# make demo NET=1gbit: the same comparison over an emulated 1 Gbit/s network (root, network namespaces)
demo: $(BENCH_STAMP)
	$(PY) scripts/demo.py $(if $(NET),--net $(NET))

bench: $(BENCH_STAMP)
	$(PY) scripts/bench_allreduce.py --loopback

# Builds the aggregator and CPU worker images with podman, trains on two worker containers against an
# aggregator container, compares with plain DDP, removes what it made (minutes; not part of make test)
containers:
	bash scripts/containers_test.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache results
