#!/usr/bin/env bash
# One command that proves omnireduce's GPU path on a (bare) GPU machine:
#
#     bash scripts/gpu_check.sh [RESULTS_DIR]        # default results/gpu/
#
# Design. Parts run in order of value, each step under its own `timeout` budget (seconds, each
# adjustable by an environment variable, e.g. GPU_CHECK_BUDGET_1_1=240), and every budget is also
# clipped to what is left of GPU_CHECK_TOTAL (default 530 s), so the whole run ends inside 9
# minutes whatever hangs; a step that cannot get GPU_CHECK_MIN_STEP seconds any more is skipped and
# says so. A step that runs past its budget is killed with its whole process group and reported as
# failed (timeout); the script moves on. Every step writes its log under RESULTS_DIR/logs/ and
# appends one line to RESULTS_DIR/summary.txt as soon as it ends (a run cut off from outside still
# leaves the lines of the steps that finished). Exit status 0 only if no step failed.
#
#   0. install    pyzmq, pytest, ... from the wheels in .wheels/ (`make wheels`), and this project
#                 (`pip install --no-deps -e .`); skipped when everything already imports
#   1. correct    the kernels' first build (timed), a cached load in a second process (timed), the
#                 GPU tests, then the path tests again with OMNIREDUCE_CUDA_KERNELS=off (torch ops)
#   2. sync-free  a DDP step with the hook, with fuse_optimizer, with AMP + GradScaler, under CUDA's
#                 sync debug mode (scripts/gpu_sync_check.py)
#   3. fast       scripts/bench_gpu.py (short sweep), a torch.profiler trace of one DDP step and
#                 whether its device-to-host copies overlap the backward pass (gpu_profile_step.py),
#                 and where compact's time goes (gpu_profile_compact.py)
#   4. end to end examples/train_recsys.py --device cuda on 2 ranks (torchrun) sharing the GPU,
#                 omnireduce against the default all-reduce (scripts/gpu_compare_runs.py)
#   5. 16 cores   scripts/bench_allreduce.py --loopback at W=4 and W=8 with 1, 2 and 4 aggregators
#   6. nccl       (only when asked for: GPU_CHECK_PARTS=nccl, its own 9-minute call) omnireduce over NCCL
#                 with 2 and 4 ranks sharing the one GPU: each rank claims a host of its own
#                 (NCCL_HOSTID=host<RANK>), every rank on cuda:0, NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1,
#                 so NCCL's socket transport on loopback carries the bytes (an emulated network, not
#                 NVLink). scripts/gpu_nccl_check.py, one JSON per step in logs/:
#                 6.1 all_reduce, all_gather_into_tensor, all_to_all_single against float64 references,
#                     NCCL_DEBUG=INFO in the log; where NCCL fails, again with NCCL_P2P_DISABLE=1, then
#                     also NCCL_SHM_DISABLE=1: the variant that worked is exported for 6.2-6.8 (none: they
#                     are skipped)
#                 6.2 parameters equal plain DDP's on NCCL every step (fp32 rtol 1e-5): the default state,
#                     engine="collective" (forced and measured), sparse COO (both engines), fp16, bf16,
#                     fuse_optimizer, AMP + GradScaler, block top-k at density 1 (both engines); W=2 and 4;
#                     every rank exits 0 after destroy_process_group returns
#                 6.3 no sync by omnireduce on the training thread with engine="collective" over NCCL
#                     (gpu_sync_check.py --backend nccl: the hook, fuse_optimizer, AMP)
#                 6.4 the hierarchy on 2 "nodes" x 2 ranks (two torchruns, --node-rank 0/1, one rendezvous)
#                 6.5 a rank SIGKILLed mid-step: the others stop within the process group's timeout, none hangs
#                 6.6 the collective engine's fixed cost in latency units (bench_engine.py): W=1 (no
#                     transport: the engine's own cost), 2 and 4; 64K-100M elements, one block to dense;
#                     the engine's own choice (GPU_CHECK_EXCHANGES=auto,union,owners,gather: also forced), against
#                     the group's 1-element and the bucket's dense all-reduce
#                 6.7 the engine's cost per bucket by phase (torch.profiler): logs/nccl_profile.json is what
#                     `scripts/cost_model.py collective --measured` reads
#                 6.8 examples/train_recsys.py --backend nccl: the hook against plain DDP (times, bytes, parameters)
#                 6.9 FSDP2 as HSDP on 2 "nodes" x 2 ranks: omnireduce across the replicas against native HSDP
#                     (parameters every step), no sync by omnireduce on the training thread
#                 6.10 the engine's kernel exchange (csrc/exchange.cu) gives the bits of its torch ops and of
#                     the same steps run on the host, at W=1, 2 and 3 (tests/test_cuda_exchange.py); with CUDA
#                     graphs the bits of the uncaptured engine, every dtype, at W=1 and 2 (tests/test_cuda_graphs.py)
#                 6.11 the engine's fixed cost with its torch ops and with the kernel exchange, in one run
#                     (bench_engine.py's exchanges auto and auto+kernels), W=1 and 2
#                 6.12 6.2's engine configs with the kernel exchange (OMNIREDUCE_ENGINE_KERNELS=1), W=2
#                 6.13 the engine with and without CUDA graphs (OMNIREDUCE_CUDA_GRAPHS=1) at W=1, 2 and 4: the same
#                     bits through the steady state and an overflow of the capacity, host time and launches per
#                     bucket (64K elements one block, 1M and 4M at 1%, 25 MiB at 0.1% and 1%): logs/nccl_graphs.json
#                     is what `scripts/cost_model.py host --measured` reads
#                 6.14 omnireduce-bench (python -m omnireduce.bench under torchrun, --backend nccl --emulate-hosts
#                     --check) at W=1, 2 and 4: torch.distributed.all_reduce against omnireduce.distributed's,
#                     1M-64M bytes at densities 0.001-1, one JSON per world size in logs/
#                 6.15 the DDP hook's host cost per bucket over NCCL (scripts/bench_hook_cost.py --backend nccl):
#                     plain DDP, torch's allreduce_hook, the hook dense and default, W=1, 2 and 4
#                 Order run: 6.1, 6.0, 6.14, 6.10, 6.13, 6.15, 6.11, 6.12, 6.6, 6.9, 6.2, 6.3, 6.8, 6.7, 6.4, 6.5.
#                 Budgets: 60+120+180+150+150+120+200+100+250+100+150+75+90+45+110+120 s at most, clipped to
#                 GPU_CHECK_TOTAL
#                 (results: docs/bench/gpu_nccl.md)
#
# Without a GPU (torch.cuda.is_available() is False) parts 1-4 and 6 are skipped with that reason and
# part 5 runs. Environment:
#   GPU_CHECK_PARTS=1,2,3,4,5  which parts (part 0 always runs, and skips itself when not needed); nccl (or 6)
#                              adds part 6
#   GPU_CHECK_SKIP=1.3,1.6     steps left out (reported skipped), e.g. those whose code has not changed
#   GPU_CHECK_QUICK=1          part 5 in a quick mode (small tensors, few iterations: under a minute on 2 cores)
#   GPU_CHECK_TOTAL=530        seconds for the whole run; GPU_CHECK_BUDGET_<part>_<step> per step
#   GPU_CHECK_INSTALL=auto     auto (install what does not import), 1 (always), 0 (never)
#   GPU_CHECK_PACK=auto        1: pack logs/ into gpu_check_logs.tar.gz and delete it (for a runner that
#                              copies back only a few files of $OUT); auto: 1 when RESULTS_DIR is $OUT
#   GPU_CHECK_CACHE            the CUDA kernels' build cache (default: a fresh directory, so 1.1 is a
#                              cold build); PYTHON (default python3) the interpreter that holds torch
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
RESULTS=${1:-results/gpu}
mkdir -p "$RESULTS/logs" || exit 2
RESULTS=$(cd "$RESULTS" && pwd)
LOGS="$RESULTS/logs"
SUMMARY="$RESULTS/summary.txt"
PY=${PYTHON:-python3}
PARTS=",${GPU_CHECK_PARTS:-1,2,3,4,5},"
SKIP_STEPS=",${GPU_CHECK_SKIP:-},"
QUICK=${GPU_CHECK_QUICK:-0}
TOTAL=${GPU_CHECK_TOTAL:-530}
MIN_STEP=${GPU_CHECK_MIN_STEP:-15}
START=$EPOCHREALTIME
DEADLINE=$(( ${START%.*} + TOTAL ))
N_PASSED=0 N_FAILED=0 N_SKIPPED=0

PACK=${GPU_CHECK_PACK:-auto}
if [[ $PACK == auto ]]; then
    PACK=0
    if [[ -n ${OUT:-} && -d $OUT && $(cd "$OUT" && pwd) == "$RESULTS" ]]; then PACK=1; fi
fi
# The interpreter's own bin/ first: ninja (cpp_extension runs it), torchrun, omnireduce-run.
PYBIN=$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null) || {
    echo "gpu_check: cannot run $PY" >&2; exit 2; }
export PATH="$PYBIN:$PATH" PYTHONUNBUFFERED=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/omnireduce-gpu-check.XXXXXX") || exit 2  # scratch: parameters, the cache
trap 'rm -rf "$WORK"' EXIT  # the parameters part 4 compares (tens of MB) and a cache of our own
export OMNIREDUCE_CUDA_BUILD_DIR=${GPU_CHECK_CACHE:-$WORK/cache}
unset OMNIREDUCE_AGGREGATORS OMNIREDUCE_CUDA_KERNELS  # the job's own aggregators; kernels by default (auto)

# --- bookkeeping ---------------------------------------------------------------------------------

seconds_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

record() {  # record ID NAME STATUS SECONDS DETAIL: one summary line, printed too
    local line
    line=$(printf '%-4s %-22s %-7s %6s s  %s' "$1" "$2" "$3" "$4" "$5")
    echo "$line" >>"$SUMMARY"
    echo "$line"
    case $3 in passed) N_PASSED=$((N_PASSED + 1)) ;; failed) N_FAILED=$((N_FAILED + 1)) ;;
        *) N_SKIPPED=$((N_SKIPPED + 1)) ;; esac
}

budget() {  # budget ID DEFAULT: GPU_CHECK_BUDGET_<ID with _ for .>, or the default
    local var="GPU_CHECK_BUDGET_${1//./_}"
    echo "${!var:-$2}"
}

detail_of() {  # the last "RESULT: ..." line a helper printed, or pytest's final tally
    local log=$1 line
    line=$(grep -a '^RESULT: ' "$log" | tail -n 1)
    if [[ -n $line ]]; then echo "${line#RESULT: }"; return; fi
    line=$(grep -aE '^=+ .*(passed|failed|skipped|error|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 | tr -d '=')
    if [[ -n $line ]]; then echo "${line# }"; return; fi
    # bench_allreduce.py's "  d=0.1   omnireduce A=1   median   40.88 ms ..." lines, one per density and method
    awk '/^  d=[0-9.]+ / { lab = ""; v = "?"
            for (i = 2; i <= NF; i++) { if ($i == "median") { v = $(i + 1); break }; lab = lab (lab ? " " : "") $i }
            sub(/^omnireduce /, "", lab); if ($1 != cur) { out = out (out ? "; " : "") $1 ":"; cur = $1 }
            out = out " " lab " " v }
         END { if (out) print out " (median ms per all-reduce)" }' "$log"
}

step() {  # step ID NAME DEFAULT_BUDGET CMD...: run CMD under its budget, log it, record the outcome
    local id=$1 name=$2 limit given left t0 rc status detail
    limit=$(budget "$id" "$3")
    given=$limit
    shift 3
    local logname="${id}_${name}.log"
    local log="$LOGS/$logname"
    if [[ $SKIP_STEPS == *",$id,"* ]]; then
        record "$id" "$name" skipped 0.0 "left out: GPU_CHECK_SKIP=${SKIP_STEPS:1:-1}"
        return
    fi
    left=$(( DEADLINE - ${EPOCHREALTIME%.*} ))
    if (( left < MIN_STEP )); then
        record "$id" "$name" skipped 0.0 "no time left: ${left} s of GPU_CHECK_TOTAL=${TOTAL} s remain"
        return
    fi
    (( limit > left )) && limit=$left
    { echo "# $id $name: $*"; echo "# budget $limit s, started $(date '+%F %T')"; } >"$log"
    t0=$EPOCHREALTIME
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1 </dev/null
    rc=$?
    local secs
    secs=$(seconds_since "$t0")
    echo "# exit status $rc after $secs s" >>"$log"
    detail=$(detail_of "$log")
    if (( rc == 124 || rc == 137 )); then
        status=failed detail="timeout after $limit s (budget $given s); log logs/$logname"
    elif (( rc == 77 )); then
        status=skipped
    elif (( rc != 0 )); then
        status=failed detail="exit status $rc${detail:+: $detail}; log logs/$logname"
    else
        status=passed
    fi
    record "$id" "$name" "$status" "$secs" "$detail"
}

skip() { record "$1" "$2" skipped 0.0 "$3"; }

want() { [[ $PARTS == *",$1,"* ]]; }

# --- header ----------------------------------------------------------------------------------------

GPU_INFO=$("$PY" - <<'EOF' 2>&1
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"yes|{torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.0f} GiB, "
          f"capability {p.major}.{p.minor}, {torch.cuda.device_count()} device(s)")
else:
    print(f"no|no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
          f"CUDA build {torch.version.cuda})")
EOF
)
GPU_INFO=$(tail -n 1 <<<"$GPU_INFO")
HAVE_GPU=${GPU_INFO%%|*}
GPU_WHY=${GPU_INFO#*|}
[[ $HAVE_GPU == yes ]] || HAVE_GPU=no
if COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null); then
    git -C "$ROOT" diff --quiet HEAD 2>/dev/null || COMMIT+=" (with local changes)"
else
    COMMIT="? (no git checkout)"
fi
{
    echo "# omnireduce GPU check, $(date '+%F %T'), $(uname -n), $(nproc) cores"
    echo "# commit $COMMIT"
    echo "# python $("$PY" -c 'import platform; print(platform.python_version())'), torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -n 1)"
    echo "# GPU: $GPU_WHY"
    command -v nvidia-smi >/dev/null && echo "# $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)"
    echo "# parts ${PARTS:1:-1}, quick ${QUICK}, total budget ${TOTAL} s; kernel cache $OMNIREDUCE_CUDA_BUILD_DIR"
    echo "# logs: logs/<id>_<name>.log$( ((PACK)) && echo ', packed into gpu_check_logs.tar.gz')"
    printf '%-4s %-22s %-7s %8s  %s\n' id step status time detail
} >"$SUMMARY"
cat "$SUMMARY"

# --- 0. install ----------------------------------------------------------------------------------

NEEDED=(zmq:pyzmq pytest:pytest pytest_timeout:pytest-timeout hypothesis:hypothesis psutil:psutil)
missing_packages() {  # pip names of what does not import (+ omnireduce if not installed from here)
    "$PY" - "$ROOT" "${NEEDED[@]}" <<'EOF'
import importlib.util, pathlib, shutil, sys
root, pairs = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2:]
missing = [pip for mod, pip in (p.split(":") for p in pairs) if importlib.util.find_spec(mod) is None]
if shutil.which("ninja") is None:
    missing.append("ninja")
try:
    import omnireduce
    if root not in pathlib.Path(omnireduce.__file__).resolve().parents:
        missing.append("omnireduce")
except ImportError:
    missing.append("omnireduce")
print(" ".join(missing))
EOF
}
MISSING=$(missing_packages 2>/dev/null)
case ${GPU_CHECK_INSTALL:-auto} in
    0) skip 0.1 install "GPU_CHECK_INSTALL=0 (missing: ${MISSING:-nothing})" ;;
    auto) if [[ -z $MISSING ]]; then skip 0.1 install "already installed (pyzmq, pytest, ..., omnireduce from $ROOT)"; fi ;;
esac
if [[ ${GPU_CHECK_INSTALL:-auto} == 1 || ( ${GPU_CHECK_INSTALL:-auto} == auto && -n $MISSING ) ]]; then
    if [[ ! -d .wheels ]]; then
        record 0.1 install failed 0.0 "missing: $MISSING, and no .wheels/ to install from (make wheels, carry .wheels)"
    else
        # The packages the GPU machine has already stay (pip keeps what satisfies the request); torch is never
        # touched. The build backend of `-e .` (setuptools, wheel) also comes from .wheels.
        step 0.1 install "$(budget 0.1 90)" bash -c "'$PY' -m pip install --no-index --find-links .wheels \
            pyzmq pytest pytest-timeout hypothesis psutil ninja && \
            '$PY' -m pip install --no-index --find-links .wheels --no-deps -e . && \
            '$PY' -c 'import zmq, omnireduce; print(\"RESULT: pyzmq\", zmq.__version__, \"omnireduce\", omnireduce.__version__)'"
    fi
fi

gpu_step() {  # like step, but skipped with the reason when there is no GPU
    if [[ $HAVE_GPU != yes ]]; then skip "$1" "$2" "$GPU_WHY"; else step "$@"; fi
}

# --- 1. correct ----------------------------------------------------------------------------------

PYTEST=("$PY" -m pytest -v -rfEs --durations=15 -p no:cacheprovider)
if want 1; then
    gpu_step 1.1 kernels-first-build 180 "$PY" scripts/gpu_prepare.py --expect built --json "$LOGS/kernels_build.json"
    gpu_step 1.2 kernels-cached-load 40 "$PY" scripts/gpu_prepare.py --expect loaded --json "$LOGS/kernels_load.json"
    # ~1000 independent kernel tests: on 2 processes where pytest-xdist is there (GPU_CHECK_XDIST=N: N, 0: one).
    # Not more by default: a few of them take ~20 GB of GPU memory each, and may run at the same time.
    XDIST=()
    if [[ ${GPU_CHECK_XDIST:-2} != 0 ]] && "$PY" -c 'import xdist' 2>/dev/null; then XDIST=(-n "${GPU_CHECK_XDIST:-2}"); fi
    gpu_step 1.3 tests-kernels 150 "${PYTEST[@]}" "${XDIST[@]}" tests/test_cuda_kernels.py
    gpu_step 1.4 tests-path 120 "${PYTEST[@]}" tests/test_cuda_path.py tests/test_device_path.py \
        tests/test_hierarchy.py::test_cuda_tensors_through_gloo_on_one_gpu \
        tests/test_amp_fusion.py::test_scaled_fused_steps_match_scaler_step_on_cuda \
        tests/test_sparse_ddp.py::test_sparse_cuda_gradients_match_default_ddp
    # test_cuda_kernels/test_cuda_build set OMNIREDUCE_CUDA_KERNELS themselves (monkeypatch): under =off
    # only the path tests change, so those run again.
    gpu_step 1.5 tests-path-kernels-off 90 env OMNIREDUCE_CUDA_KERNELS=off "${PYTEST[@]}" \
        tests/test_cuda_path.py tests/test_device_path.py
    # 1.6 (tests/test_cuda_build.py: its GPU test is a second cold build, by two processes at once) runs last
    # of all: 1.1 and 1.2 already built and loaded the kernels.
fi

# --- 2. sync-free --------------------------------------------------------------------------------

if want 2; then
    gpu_step 2.1 sync-hook 60 "$PY" scripts/gpu_sync_check.py --config hook --json "$LOGS/sync_hook.json"
    gpu_step 2.2 sync-fused-optimizer 60 "$PY" scripts/gpu_sync_check.py --config fused --json "$LOGS/sync_fused.json"
    gpu_step 2.3 sync-amp-gradscaler 60 "$PY" scripts/gpu_sync_check.py --config amp --json "$LOGS/sync_amp.json"
fi

# --- 3. fast -------------------------------------------------------------------------------------

if want 3; then
    # 100 MiB over the density sweep in each dtype (about 8 s each on an H200)
    gpu_step 3.1 bench-kernels 60 bash -c 'for dt in float32 float16 bfloat16; do "$0" scripts/bench_gpu.py \
        --sizes-mb 100 --densities 0.001,0.01,0.1,0.5,1 --dtype "$dt" --repeats 21 --warmup 3 --hook-steps 0 \
        --json "$1/bench_gpu_$dt.json" || exit; done' "$PY" "$LOGS"
    gpu_step 3.2 profile-ddp-step 60 "$PY" scripts/gpu_profile_step.py --trace "$LOGS/ddp_step_trace.json" \
        --json "$LOGS/ddp_step_overlap.json"
    # where compact's time goes (its fixed costs, beside the flags pass): the next kernel work's numbers
    gpu_step 3.3 profile-compact 60 "$PY" scripts/gpu_profile_compact.py --sizes-mb 4,100 --densities 0.01,1 \
        --json "$LOGS/compact_profile.json"
fi

# --- 4. end to end -------------------------------------------------------------------------------

if want 4; then
    E2E_STEPS=${GPU_CHECK_E2E_STEPS:-30}
    for hook in omnireduce allreduce; do
        n=$([[ $hook == omnireduce ]] && echo 1 || echo 2)
        gpu_step "4.$n" "recsys-$hook" 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            examples/train_recsys.py --device cuda --hook "$hook" --steps "$E2E_STEPS" --optimizer sgd \
            --summary-json "$LOGS/recsys_$hook.json" --save-params "$WORK/recsys_$hook.pt"
    done
    gpu_step 4.3 recsys-compare 30 "$PY" scripts/gpu_compare_runs.py --dir "$LOGS" --params "$WORK" --out "$LOGS/recsys_compare.txt"
fi

# --- 5. the 16 cores -----------------------------------------------------------------------------

if want 5; then
    if [[ $QUICK == 1 ]]; then
        BENCH=(--size-mib 4 --densities 0.1 --iters 2 --warmup 1 --methods "omnireduce,collective,gloo")
    else
        BENCH=(--size-mib 16 --densities "1,0.1,0.01" --iters 3 --warmup 1 --methods "omnireduce,collective,gloo")
    fi
    for W in 4 8; do
        step "5.$((W / 4))" "loopback-W$W" 90 "$PY" scripts/bench_allreduce.py --loopback --workers "$W" \
            --aggregators "1,2,4" "${BENCH[@]}" --json "$LOGS/bench_allreduce_W$W.json"
    done
fi

# --- 6. nccl: several ranks on the one GPU through NCCL --------------------------------------------

if want nccl || want 6; then
    NCCL=("$PY" scripts/gpu_nccl_check.py)
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1}
    gpu_step 6.1 nccl-collectives 60 "${NCCL[@]}" collectives --json "$LOGS/nccl_collectives.json"
    # the variant 6.1 found working (its NCCL_P2P_DISABLE / NCCL_SHM_DISABLE), for every later step; no file
    # (6.1 left out): as is; a file saying none worked: the rest is skipped
    if VARIANT=$("$PY" scripts/gpu_nccl_check.py variant-env "$LOGS/nccl_collectives.json" 2>>"$LOGS/variant_env.log"); then
        for kv in $VARIANT; do export "${kv?}"; done
        nccl_step() { gpu_step "$@"; }
    else
        nccl_step() { skip "$1" "$2" "NCCL failed in every variant in 6.1 (logs/6.1_nccl-collectives.log)"; }
    fi
    # (in order of value: the engine's cost first; a call cut short still has what ran). The kernels are
    # built first, in a step of their own, so that no timed job pays for their build.
    nccl_step 6.0 nccl-kernels 120 "$PY" -c 'import torch; from omnireduce.cuda import build
x = torch.zeros(1, device="cuda"); print("RESULT:", "CUDA kernels loaded" if build.extension_for(x) is not None
else "torch ops: " + build.describe())'
    # the installed command, as a user runs it on a cluster (here every rank on the one GPU, a host each)
    nccl_step 6.14 nccl-omnireduce-bench 180 bash -c 'rc=0; for W in 1 2 4; do "$0" -m torch.distributed.run \
        --standalone --nproc-per-node "$W" -m omnireduce.bench --backend nccl --emulate-hosts -b 1M -e 64M -f 8 \
        -d 0.001,0.01,0.1,1 -n 5 -w 2 --check --json "$1/omnireduce_bench_W$W.json" || rc=1; done
        exit $rc' "$PY" "$LOGS"
    nccl_step 6.10 nccl-kernel-exchange 150 env OMNIREDUCE_CUDA_KERNELS=require "${PYTEST[@]}" \
        tests/test_cuda_exchange.py tests/test_cuda_graphs.py
    nccl_step 6.13 nccl-graphs 150 env OMNIREDUCE_CUDA_KERNELS=require "${NCCL[@]}" graphs --worlds 1,2,4 \
        --warmup 3 --repeats 10 --launch-timeout 60 --json "$LOGS/nccl_graphs.json"
    nccl_step 6.15 nccl-hook-cost 120 "$PY" scripts/bench_hook_cost.py --backend nccl --worlds 1,2,4 --repeats 3 \
        --models linear32 --json "$LOGS/nccl_hook_cost.json"
    nccl_step 6.11 nccl-engine-kernels 200 "${NCCL[@]}" engine --worlds 1,2 --repeats 5 --warmup 2 \
        --launch-timeout 95 --engine-sizes 65536,1048576,16777216 --engine-densities one,0.01,1 \
        --exchanges auto,auto+kernels --json "$LOGS/nccl_engine_kernels.json"
    nccl_step 6.12 nccl-parity-kernels 100 env OMNIREDUCE_ENGINE_KERNELS=1 "${NCCL[@]}" parity --worlds 2 \
        --configs collective,collective-measure,sparse-coo-collective --json "$LOGS/nccl_parity_kernels.json"
    nccl_step 6.6 nccl-engine 250 "${NCCL[@]}" engine --worlds 1,2,4 --repeats 5 --warmup 2 --launch-timeout 80 \
        --engine-sizes 65536,1048576,16777216,104857600 --engine-densities one,0.001,0.01,0.1,1 \
        --exchanges "${GPU_CHECK_EXCHANGES:-auto}" --json "$LOGS/nccl_engine.json"
    nccl_step 6.9 nccl-fsdp 100 "${NCCL[@]}" fsdp --launch-timeout 90 --json "$LOGS/nccl_fsdp.json"
    nccl_step 6.2 nccl-parity 150 "${NCCL[@]}" parity --json "$LOGS/nccl_parity.json"
    nccl_step 6.3 nccl-sync-free 75 bash -c 'rc=0; for c in hook fused amp; do "$0" scripts/gpu_sync_check.py \
        --config "$c" --backend nccl --engine collective --json "$1/nccl_sync_$c.json"; s=$?; ((s == 77)) && exit 77
        ((s)) && rc=1; done; exit $rc' "$PY" "$LOGS"
    nccl_step 6.8 nccl-recsys 90 "${NCCL[@]}" recsys --steps "${GPU_CHECK_NCCL_STEPS:-20}" \
        --json "$LOGS/nccl_recsys.json"
    nccl_step 6.7 nccl-profile 45 "${NCCL[@]}" profile --trace-dir "$LOGS" --json "$LOGS/nccl_profile.json"
    nccl_step 6.4 nccl-hierarchy 110 "${NCCL[@]}" hierarchy --pg-timeout 20 --launch-timeout 90 \
        --json "$LOGS/nccl_hierarchy.json"
    nccl_step 6.5 nccl-rank-dies 120 "${NCCL[@]}" dies --pg-timeout 15 --json "$LOGS/nccl_dies.json"
fi

if want 1; then
    gpu_step 1.6 tests-build 150 "${PYTEST[@]}" tests/test_cuda_build.py
fi

# --- the end -------------------------------------------------------------------------------------

VERDICT=$( ((N_FAILED)) && echo FAILED || echo PASSED )
{
    echo "# $VERDICT: $N_PASSED passed, $N_FAILED failed, $N_SKIPPED skipped in $(seconds_since "$START") s"
} >>"$SUMMARY"
if ((PACK)); then
    tar -czf "$RESULTS/gpu_check_logs.tar.gz" -C "$RESULTS" logs && rm -rf "$LOGS"
fi
tail -n 1 "$SUMMARY"
((N_FAILED == 0))
