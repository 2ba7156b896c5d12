#!/usr/bin/env bash
# The container images, built and run for real (`make containers`; minutes, not part of `make test`).
#
#   1. builds docker/Dockerfile.aggregator and the CPU variant of docker/Dockerfile.worker with podman;
#   2. runs the aggregator container (token from a podman secret, non-root) and checks its HEALTHCHECK
#      (`omnireduce-agg --check`) says healthy, and that a probe of a wrong port says unhealthy;
#   3. runs two CPU worker containers that train examples/train_recsys.py for a few steps with the
#      omnireduce hook, then again with DDP's default all-reduce, and compares the parameters of the
#      two runs (within 1e-5);
#   4. reads the aggregator container's Prometheus endpoint (slots completed > 0);
#   5. stops the aggregator with SIGTERM and expects exit status 0 within the grace period;
#   6. removes everything it made, on success, failure or Ctrl-C: containers, the secret, the images it
#      built (and the base image, if it had to build one), its temporary directory. It then checks
#      that podman's lists of containers, images, volumes and secrets are as they were before.
#
# Needs podman (run as root). When podman is missing and apt-get is there, it installs podman, runc and
# debootstrap from Debian's packages (OMNIREDUCE_CT_INSTALL=0 to refuse). All containers use the host
# network and listen on 127.0.0.1 only.
#
# Base image: nothing is pulled. With OMNIREDUCE_CT_BASE=IMAGE (e.g. python:3.11-slim on a machine that
# reaches a registry) that image is used; otherwise localhost/omnireduce-base:bookworm is reused when
# it exists, or built with `debootstrap --variant=minbase bookworm` + `podman import` (2-4 minutes)
# and removed at the end unless OMNIREDUCE_CT_KEEP_BASE=1 (then later runs reuse it).
#
# Other settings: OMNIREDUCE_CT_STEPS (training steps, default 6), OMNIREDUCE_CT_KEEP=1 (keep the
# containers and images for a look; `podman rm -f`/`podman rmi` them yourself), DEBIAN_MIRROR.
# The host's CA bundle (/etc/ssl/certs/ca-certificates.crt) is mounted read-only into the builds
# for pip, and a directory of local wheels named by $PIP_FIND_LINKS (holding a torch wheel) is
# mounted too; without one, torch comes from PyTorch's CPU wheel index.
set -euo pipefail

cd "$(dirname "$0")/.."
RUN_ID="omnireduce-ct-$$"
STEPS=${OMNIREDUCE_CT_STEPS:-6}
BASE_TAG=localhost/omnireduce-base:bookworm
AGG_IMAGE="localhost/omnireduce-agg:$RUN_ID"
WORKER_IMAGE="localhost/omnireduce-worker:$RUN_ID-cpu"
SECRET="$RUN_ID-token"
HOST_CA=/etc/ssl/certs/ca-certificates.crt
T0=$SECONDS

say() { printf '[containers %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
fail() { say "FAIL: $*"; exit 1; }

# -- podman ------------------------------------------------------------------------------------------

if ! command -v podman >/dev/null; then
    if [[ ${OMNIREDUCE_CT_INSTALL:-1} == 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        say "podman is missing: apt-get install podman runc debootstrap"
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap >/dev/null
    else
        fail "podman is not installed (apt-get install podman runc debootstrap)"
    fi
fi
if [[ $(id -u) != 0 ]]; then
    fail "run as root: the test uses rootful podman (host network, debootstrap)"
fi

# The worker image holds torch: building it took 4 GiB at its peak here, in podman's storage (the layers, a copy
# of the last one while it is committed) and in the temporary directory. Say so before building rather
# than fail in the middle of a commit with "no space left on device".
MIN_FREE_GB=${OMNIREDUCE_CT_MIN_FREE_GB:-6}
GRAPH_ROOT=$(podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers/storage)
for dir in "$GRAPH_ROOT" "${TMPDIR:-/tmp}"; do
    probe=$dir
    while [[ ! -d $probe ]]; do probe=$(dirname "$probe"); done
    free_gb=$(df -Pk "$probe" | awk 'NR == 2 {print int($4 / 1048576)}')
    if (( free_gb < MIN_FREE_GB )); then
        fail "only $free_gb GiB free under $dir ($probe); building the images needs about $MIN_FREE_GB GiB (OMNIREDUCE_CT_MIN_FREE_GB)"
    fi
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/$RUN_ID.XXXXXX")
# podman's own defaults ask the runtime to set rlimits and, with crun, cgroups; some sandboxes refuse
# both. This configuration only affects the podman commands below.
{
    echo "[containers]"
    echo "default_ulimits = []"
    if command -v runc >/dev/null; then echo "[engine]"; echo 'runtime = "runc"'; fi
} > "$WORK/containers.conf"
export CONTAINERS_CONF="$WORK/containers.conf"

snapshot() {  # what podman holds, to check that the test leaves it as it found it
    {
        podman ps -aq --external --no-trunc  # --external: buildah's working containers too
        podman images -aq --no-trunc
        podman volume ls -q
        podman secret ls --format '{{.Name}}'
    } 2>/dev/null | sed 's/^sha256://' | sort
}
snapshot > "$WORK/before"

MADE_BASE=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ $rc != 0 ]] && grep -qv "systemd connection" "$WORK/podman.err" 2>/dev/null; then
        say "podman's messages:"
        grep -v "systemd connection" "$WORK/podman.err" | tail -20
    fi
    if [[ ${OMNIREDUCE_CT_KEEP:-0} == 1 ]]; then
        say "OMNIREDUCE_CT_KEEP=1: leaving containers $RUN_ID-*, images $AGG_IMAGE $WORKER_IMAGE"
    else
        local ids
        local ids id
        ids=$(podman ps -aq --filter "name=^$RUN_ID-" 2>/dev/null || true)
        # shellcheck disable=SC2086  # one argument per container id
        if [[ -n $ids ]]; then podman rm -f -t 2 $ids >/dev/null 2>&1 || true; fi
        # An interrupted build leaves its working container (FROM the base) behind: remove the new ones.
        if [[ -n ${BASE:-} ]]; then
            for id in $(podman ps -aq --external --no-trunc --filter "ancestor=$BASE" 2>/dev/null); do
                grep -qx "$id" "$WORK/before" || podman rm -f "$id" >/dev/null 2>&1 || true
            done
        fi
        podman secret rm "$SECRET" >/dev/null 2>&1 || true
        podman rmi -f "$AGG_IMAGE" "$WORKER_IMAGE" >/dev/null 2>&1 || true
        if [[ $MADE_BASE == 1 && ${OMNIREDUCE_CT_KEEP_BASE:-0} != 1 ]]; then
            podman rmi -f "$BASE_TAG" >/dev/null 2>&1 || true
        fi
        if [[ $MADE_BASE == 1 && ${OMNIREDUCE_CT_KEEP_BASE:-0} == 1 ]]; then
            podman image inspect "$BASE_TAG" --format '{{.Id}}' 2>/dev/null | sed 's/^sha256://' >> "$WORK/before" || true
        fi
        snapshot > "$WORK/after"
        if ! diff <(sort "$WORK/before") "$WORK/after" > "$WORK/leftover"; then
            say "WARNING: podman state differs from before the test:"
            cat "$WORK/leftover"
            [[ $rc == 0 ]] && rc=1
        else
            say "cleaned up: no containers, images, volumes or secrets left behind"
        fi
    fi
    rm -rf "$WORK"
    if [[ $rc == 0 ]]; then say "PASSED"; else say "FAILED (exit $rc)"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    if command -v python3 >/dev/null; then
        python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
    else
        echo $((20000 + RANDOM % 20000))
    fi
}

http_get() {
    if command -v curl >/dev/null; then
        curl -fsS --max-time 10 "$1"
    else
        python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"
    fi
}

# -- images --------------------------------------------------------------------------------------------

if [[ -n ${OMNIREDUCE_CT_BASE:-} ]]; then
    BASE=$OMNIREDUCE_CT_BASE
    say "base image $BASE (from OMNIREDUCE_CT_BASE)"
elif podman image exists "$BASE_TAG"; then
    BASE=$BASE_TAG
    say "base image $BASE (already here; kept)"
else
    BASE=$BASE_TAG
    command -v debootstrap >/dev/null || fail "debootstrap is not installed (apt-get install debootstrap)"
    say "building base image $BASE with debootstrap (minbase bookworm + python3, venv, pip)"
    MADE_BASE=1
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm \
        "$WORK/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap failed"; }
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/* \
        "$WORK"/rootfs/usr/share/doc/* "$WORK"/rootfs/usr/share/man/* "$WORK"/rootfs/usr/share/locale/*
    tar -C "$WORK/rootfs" -c . | podman import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
        - "$BASE" >/dev/null 2>>"$WORK/podman.err" || fail "podman import of the base image failed"
    rm -rf "$WORK/rootfs"
fi

BUILD=(podman build --format docker --network host --layers=false --build-arg "BASE=$BASE")
if [[ -r $HOST_CA ]]; then  # for pip behind a TLS-intercepting proxy; the base has the same path
    BUILD+=(-v "$HOST_CA:/etc/ssl/certs/ca-certificates.crt:ro" --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
fi
TORCH=$(grep -E '^torch==' constraints.txt | head -1)
[[ -n $TORCH ]] || fail "constraints.txt pins no torch==VERSION"
WORKER_ARGS=(--build-arg "TORCH=$TORCH")
WHEELS=""
for d in ${PIP_FIND_LINKS:-}; do
    if [[ -d $d ]] && compgen -G "$d/torch-*.whl" >/dev/null; then WHEELS=$d; break; fi
done
if [[ -n $WHEELS ]]; then
    WORKER_ARGS+=(-v "$WHEELS:/mnt:ro" --build-arg PIP_FIND_LINKS=/mnt)
    say "torch wheels from $WHEELS (mounted into the build)"
else
    WORKER_ARGS+=(--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)
fi

t=$SECONDS
say "building $AGG_IMAGE"
"${BUILD[@]}" -f docker/Dockerfile.aggregator -t "$AGG_IMAGE" . > "$WORK/build-agg.log" 2>&1 \
    || { tail -30 "$WORK/build-agg.log"; fail "building the aggregator image"; }
AGG_BUILD_S=$((SECONDS - t))
t=$SECONDS
say "building $WORKER_IMAGE ($TORCH)"
"${BUILD[@]}" "${WORKER_ARGS[@]}" -f docker/Dockerfile.worker -t "$WORKER_IMAGE" . > "$WORK/build-worker.log" 2>&1 \
    || { tail -30 "$WORK/build-worker.log"; fail "building the worker image"; }
WORKER_BUILD_S=$((SECONDS - t))

size() { podman image inspect --format '{{.Size}}' "$1"; }
mb() { awk -v b="$1" 'BEGIN {printf "%.0f MB", b / 1e6}'; }
base_size=$(size "$BASE")
agg_size=$(size "$AGG_IMAGE")
worker_size=$(size "$WORKER_IMAGE")
say "image sizes (uncompressed): base $(mb "$base_size"); aggregator $(mb "$agg_size") ($(mb $((agg_size - base_size))) over the base, built in ${AGG_BUILD_S}s); CPU worker $(mb "$worker_size") ($(mb $((worker_size - base_size))) over the base, built in ${WORKER_BUILD_S}s)"
[[ $(podman image inspect --format '{{.Config.User}}' "$AGG_IMAGE") == 10001:10001 ]] || fail "aggregator image does not run as uid 10001"
podman run --rm --entrypoint python3 "$AGG_IMAGE" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is not None)' \
    2>>"$WORK/podman.err" || fail "the aggregator image has torch"

# -- the aggregator ------------------------------------------------------------------------------------

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$WORK/token"
podman secret create "$SECRET" "$WORK/token" >/dev/null
rm -f "$WORK/token"
AGG_PORT=$(free_port)
METRICS_PORT=$(free_port)
AGG="tcp://127.0.0.1:$AGG_PORT"
say "starting the aggregator container on $AGG (metrics on 127.0.0.1:$METRICS_PORT)"
# As locked down as the Kubernetes manifests run it: read-only root, no capabilities, no privilege gain.
# (podman 4.3 cannot create a secret's mount point on a read-only root: hence the tmpfs under it.)
podman run -d --name "$RUN_ID-agg" --network host --read-only --cap-drop ALL --security-opt no-new-privileges \
    --tmpfs /run/secrets --secret "$SECRET,target=omnireduce_token,uid=10001,gid=10001,mode=0400" \
    -e "OMNIREDUCE_CHECK_ADDRESS=$AGG" \
    "$AGG_IMAGE" --listen "$AGG" --metrics-port "$METRICS_PORT" --metrics-host 127.0.0.1 \
    > /dev/null 2>>"$WORK/podman.err" || fail "podman could not start the aggregator container"
for _ in $(seq 100); do
    podman logs "$RUN_ID-agg" 2>/dev/null | grep -q "listening on" && break
    [[ $(podman inspect --format '{{.State.Running}}' "$RUN_ID-agg") == true ]] \
        || { podman logs "$RUN_ID-agg"; fail "the aggregator container exited"; }
    sleep 0.2
done
podman logs "$RUN_ID-agg" 2>/dev/null | grep -q "listening on" || fail "the aggregator never said it was listening"
# The image's HEALTHCHECK, run now (podman's timers need systemd; this runs the same command).
health=$(podman healthcheck run "$RUN_ID-agg" 2>>"$WORK/podman.err") \
    || { podman inspect --format '{{json .State.Health}}' "$RUN_ID-agg"; fail "healthcheck: ${health:-no output}"; }
say "HEALTHCHECK: ${health:-healthy} ($(podman inspect --format '{{(index .State.Health.Log 0).Output}}' "$RUN_ID-agg" 2>/dev/null | head -1))"
if podman exec "$RUN_ID-agg" omnireduce-agg --check "tcp://127.0.0.1:$(free_port)" --check-timeout 2 > "$WORK/neg" 2>&1; then
    fail "--check of a port nothing listens on said healthy"
fi
say "--check of a wrong port: exit 1, $(cat "$WORK/neg")"

# -- two CPU workers, twice ------------------------------------------------------------------------------

OUT="$WORK/out"
mkdir -p "$OUT"
chmod 0777 "$OUT"  # the workers run as uid 10001
run_workers() {  # $1: hook (omnireduce or allreduce)
    local hook=$1 master_port r
    master_port=$(free_port)
    for r in 0 1; do
        podman run -d --name "$RUN_ID-w$r-$hook" --network host \
            --secret "$SECRET,target=omnireduce_token,uid=10001,gid=10001,mode=0400" \
            -e RANK=$r -e LOCAL_RANK=$r -e WORLD_SIZE=2 -e MASTER_ADDR=127.0.0.1 -e MASTER_PORT="$master_port" \
            -e GLOO_SOCKET_IFNAME=lo -e OMNIREDUCE_AGGREGATORS="$AGG" \
            -e OMNIREDUCE_TOKEN_FILE=/run/secrets/omnireduce_token \
            -v "$OUT:/out" "$WORKER_IMAGE" \
            python3 examples/train_recsys.py --hook "$hook" --steps "$STEPS" --batch-size 128 --log-every 1 \
            --save-params "/out/$hook.pt" --summary-json "/out/$hook.json" > /dev/null 2>>"$WORK/podman.err" \
            || fail "podman could not start worker $r ($hook)"
    done
    for r in 0 1; do
        local code
        code=$(timeout 600 podman wait "$RUN_ID-w$r-$hook" 2>/dev/null) || code=timeout
        if [[ $code != 0 ]]; then
            for q in 0 1; do echo "--- worker $q ($hook)"; podman logs "$RUN_ID-w$q-$hook" 2>&1 | tail -30; done
            fail "worker $r ($hook) exited with $code"
        fi
    done
    podman logs "$RUN_ID-w0-$hook" 2>&1 | grep -E "ranks|median step" | sed "s/^/    [$hook rank 0] /"
    podman rm "$RUN_ID-w0-$hook" "$RUN_ID-w1-$hook" > /dev/null
}
say "training $STEPS steps on 2 worker containers with the omnireduce hook"
run_workers omnireduce
say "training $STEPS steps on 2 worker containers with DDP's default all-reduce"
run_workers allreduce

say "comparing parameters"
cat > "$OUT/compare.py" <<'PY'
import json
import sys

import torch

a, b = torch.load("/out/omnireduce.pt"), torch.load("/out/allreduce.pt")
assert a.keys() == b.keys(), "different parameter names"
worst = max((x.double() - b[k].double()).abs().max().item() for k, x in a.items())
s = json.load(open("/out/omnireduce.json"))
print(f"    {len(a)} tensors, {sum(x.numel() for x in a.values()):,} values: largest difference {worst:.3g} "
      f"(tolerance 1e-5); omnireduce buckets: {s['buckets_sparse']} sparse, {s['buckets_dense']} dense; "
      f"{s['mb_sent_per_step']:.2f} MB sent per step per rank against {s['dense_mb_per_step']:.2f} MB dense")
sys.exit(0 if worst <= 1e-5 and s["buckets_sparse"] > 0 else 1)
PY
podman run --rm --name "$RUN_ID-compare" -v "$OUT:/out:ro" "$WORKER_IMAGE" python3 /out/compare.py \
    || fail "parameters differ from plain DDP (or no bucket went through omnireduce)"

# -- metrics, then SIGTERM -----------------------------------------------------------------------------------

http_get "http://127.0.0.1:$METRICS_PORT/metrics" > "$WORK/metrics" || fail "the metrics endpoint did not answer"
slots=$(awk '$1 == "omnireduce_aggregator_slots_completed_total" {print int($2)}' "$WORK/metrics")
[[ ${slots:-0} -gt 0 ]] || { grep omnireduce_ "$WORK/metrics" | head -20; fail "metrics: no slots completed"; }
say "metrics endpoint: omnireduce_aggregator_slots_completed_total $slots, $(grep -c '^omnireduce_aggregator_' "$WORK/metrics") series"

t=$SECONDS
podman stop -t 30 "$RUN_ID-agg" > /dev/null 2>>"$WORK/podman.err"
code=$(podman inspect --format '{{.State.ExitCode}}' "$RUN_ID-agg")
[[ $code == 0 ]] || { podman logs "$RUN_ID-agg" 2>&1 | tail; fail "aggregator exited with $code after SIGTERM"; }
podman logs "$RUN_ID-agg" 2>&1 | grep -q "received SIGTERM, stopped" || fail "the aggregator did not log SIGTERM"
say "SIGTERM: the aggregator stopped in $((SECONDS - t))s with exit status 0"
