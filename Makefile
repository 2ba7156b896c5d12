# omnireduce: `make test` and `make demo` work on a fresh machine (they create .venv themselves).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
NET ?=

.PHONY: test test-e2e lint venv clean bench demo soak exit-loop containers wheels

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

# The slow end-to-end runs (marker e2e: trainings under real torchrun, the example scripts, mpiexec,
# emulated networks), left out of make test; CI runs both
test-e2e: $(STAMP)
	$(PY) -m pytest -q -m e2e

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

# Wheels for scripts/gpu_check.sh on a bare GPU machine with no index (it has torch; not pyzmq): what the
# tests need beside torch, and the build backend of `pip install -e .`, for CPython $(WHEELS_PY) on x86-64
# Linux. Carry .wheels with the working tree (git-ignored); about 5 MB.
WHEELS_PY ?= 3.12
WHEELS := pyzmq pytest pytest-timeout hypothesis psutil ninja 'setuptools>=77' wheel
wheels:
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(WHEELS_PY) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .wheels $(WHEELS)
	@ls .wheels

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache results
