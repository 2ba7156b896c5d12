# omnireduce: `make test` and `make demo` work on a fresh machine (they create .venv themselves).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
TORCHREC_STAMP := $(VENV)/.torchrec-stamp
NET ?=

.PHONY: test test-e2e test-pythons test-oldest-torch lint venv clean bench demo soak exit-loop containers wheels docs torchrec host-cost

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# vermin: no library module, function or syntax newer than requires-python's floor (ruff's target-version
# covers syntax too); `--exclude long`: torch's Tensor.long() reads to vermin as Python 2's long
PY_FLOOR := $(shell sed -n 's/^requires-python = ">=\([0-9.]*\)"/\1/p' pyproject.toml)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/vermin -q --no-tips --violations --eval-annotations --exclude long -t=$(PY_FLOOR)- \
		omnireduce aggregator worker csrc deploy docs examples scripts tests
	$(PY) scripts/check_layers.py
	$(PY) scripts/typecheck.py

test: lint
	$(PY) -m pytest -q

# The torch-free tests on the oldest and newest Python the package supports, each in a venv of its own
# without torch (.venv-3.10, .venv-3.13; scripts/test_pythons.sh says which tests and how it finds each Python)
PYTHONS ?= 3.10 3.13
test-pythons:
	bash scripts/test_pythons.sh $(PYTHONS)

# make test's tests (the fast suite: the hook, the engines, the functional API, the integrations, the
# rest) on the oldest torch the package promises, pyproject's floor (torch>=2.8: torch 2.8.0), on Python
# 3.10, in a venv of its own, .venv-torch-oldest (make clean removes it with every .venv-*): the test
# extras at constraints.txt's pins but torch's. Nothing is left out: as in make test, TorchRec's tests
# skip without TorchRec (make torchrec, on the pinned torch) and the CUDA ones without a GPU; the FSDP2
# integration's skip with its own refusal (it needs torch 2.9), which tests/test_torch_versions.py checks.
# CI does not run it: pip has torch 2.8.0 only as the CUDA build, about 5 GB of wheels for a fresh clone.
# OLDEST_VENV=path uses (and installs into) a venv of Python 3.10 that already has that torch.
OLDEST_TORCH := $(shell sed -n 's/^torch = \["torch>=\([0-9.]*\)".*/\1/p' pyproject.toml).0
OLDEST_VENV ?= .venv-torch-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.installed-stamp
OLDEST_MIN_PASSED ?= 1300  # 1332 pass on this 2-core VM (no GPU, as root)

$(OLDEST_STAMP): pyproject.toml constraints.txt
	test -x $(OLDEST_VENV)/bin/python || "$$(bash scripts/find_python.sh 3.10)" -m venv $(OLDEST_VENV)
	{ grep -v '^torch==' constraints.txt; echo 'torch==$(OLDEST_TORCH)'; } > $(OLDEST_VENV)/constraints.txt
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q -c $(OLDEST_VENV)/constraints.txt -e '.[test]'
	$(OLDEST_VENV)/bin/python -c 'import sys, torch; v = sys.version_info[:2], torch.__version__.split("+")[0]; \
		sys.exit(None if v == ((3, 10), "$(OLDEST_TORCH)") else f"{v}: not Python 3.10 with torch $(OLDEST_TORCH)")'
	touch $(OLDEST_STAMP)

test-oldest-torch: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider --min-passed $(OLDEST_MIN_PASSED)

# The API reference from the docstrings, and the benchmark tables from docs/bench/*.json
# (tests/test_docs.py fails while either is stale)
docs: $(STAMP)
	$(PY) scripts/gen_reference.py
	$(PY) scripts/bench_tables.py

# The slow end-to-end runs (marker e2e: trainings under real torchrun, the example scripts, mpiexec,
# emulated networks), left out of make test; CI runs both
test-e2e: $(STAMP)
	$(PY) -m pytest -q -m e2e

soak: $(STAMP)
	$(PY) -m pytest -q -s -m slow tests/test_soak.py

# The README's script under torchrun, 100 times per layout (one node, two nodes, fused optimizer):
# every run exits 0, prints no warning, leaves nothing running; and a profiled collective engine's
# script 50 times, an omnireduce.distributed.all_reduce script at 2 ranks 48 times and a DDP script on
# the hook's collective engine at 2 ranks 36 times, none aborting at exit (~50 minutes; not part of make test)
exit-loop: $(STAMP)
	$(PY) -m pytest -q -m slow tests/test_clean_exit.py tests/test_engine_exit.py tests/test_distributed_exit.py \
		tests/test_default_group.py \
		tests/test_ddp_engine_exit.py

# TorchRec on CPU (tests/test_torchrec.py; about a minute, not part of make test, which skips it without
# TorchRec). The torchrec wheel asks for the CUDA fbgemm-gpu: it goes in without its dependencies, beside
# fbgemm-gpu-cpu and what it imports, all pinned in constraints.txt; then torch must still be the pinned one.
TORCHREC_DEPS := fbgemm-gpu-cpu tensordict pyre-extensions torchmetrics tqdm
$(TORCHREC_STAMP): $(STAMP) constraints.txt
	$(PY) -m pip install -q -c constraints.txt $(TORCHREC_DEPS)
	$(PY) -m pip install -q -c constraints.txt --no-deps torchrec
	test "$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')" = "$$(sed -n 's/^torch==//p' constraints.txt)"
	$(PY) -c 'import torchrec.distributed.model_parallel'
	touch $(TORCHREC_STAMP)

torchrec: $(TORCHREC_STAMP)
	$(PY) -m pytest -q -m torchrec tests/test_torchrec.py

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	touch $(BENCH_STAMP)

# make demo NET=1gbit: the same comparison over an emulated 1 Gbit/s network (root, network namespaces)
demo: $(BENCH_STAMP)
	$(PY) scripts/demo.py $(if $(NET),--net $(NET))

bench: $(BENCH_STAMP)
	$(PY) scripts/bench_allreduce.py --loopback

# A bucket's host cost (docs/bench/host_cost.md): each step of the hook's and the engine's way timed, then the
# hook against plain DDP and torch's allreduce_hook on one rank; BEFORE=DIR (an older commit's source tree)
# runs that code in turns with this one (a minute or two; BEFORE: several)
host-cost: $(BENCH_STAMP)
	$(PY) scripts/profile_host_cost.py $(if $(BEFORE),--before $(BEFORE) --rounds 3 --engine-only)
	$(PY) scripts/bench_hook_cost.py --worlds 1 --repeats 3 $(if $(BEFORE),--before $(BEFORE))

# Builds the aggregator and CPU worker images with podman, trains on two worker containers against an
# aggregator container, compares with plain DDP, removes what it made (minutes; not part of make test)
containers:
	bash scripts/containers_test.sh

# Wheels for scripts/gpu_check.sh on a bare GPU machine with no index (it has torch; not pyzmq): what the
# tests need beside torch, and the build backend of `pip install -e .`, for CPython $(WHEELS_PY) on x86-64
# Linux. Carry .wheels with the working tree (git-ignored); about 5 MB. The NCCL part (GPU_CHECK_PARTS=nccl)
# needs nothing more: NCCL and torchrun come with torch, the rest is this list.
WHEELS_PY ?= 3.12
WHEELS := pyzmq pytest pytest-timeout hypothesis psutil ninja 'setuptools>=77' wheel
wheels:
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(WHEELS_PY) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .wheels $(WHEELS)
	@ls .wheels

clean:
	rm -rf $(VENV) .venv-* build *.egg-info .pytest_cache .ruff_cache results
