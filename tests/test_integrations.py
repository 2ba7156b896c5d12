"""No aggregator addresses anywhere: PyTorch Lightning, Hugging Face Accelerate and Transformers, and
torchrun (two "nodes" on this machine), mpiexec and omnireduce-run, each with the job's own
(colocated) aggregators. Real processes, CPU, Gloo. Parameters are compared with the same run
through DDP's own all-reduce (1e-5), and the hook's stats() must show the sparse path."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from omnireduce.launch.procs import free_port
from tests.harness import finish_session

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RANKED = str(ROOT / "tests" / "scripts" / "colocated_ddp.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
_LAUNCHER_VARS = ("OMNIREDUCE_AGGREGATORS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}:{os.environ.get('PATH', '')}", **extra)
    return env


def _start(cmd: list[str], **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(p: subprocess.Popen[str], timeout: float = 150) -> str:
    return finish_session(p, timeout)


def _json_lines(out: str) -> list[dict]:
    """The JSON objects the ranks printed (each has a "rank"). Ranks of one node share torchrun's stdout,
    stderr goes to the same pipe, and an unbuffered print writes the object and its newline separately: so
    another rank's object, or a log record of another thread, can follow an object on its line."""
    decoder, found = json.JSONDecoder(), []
    for line in out.splitlines():
        if not re.match(r"^(\[rank \d+\] )?\{", line):
            continue
        pos = line.index("{")
        while pos >= 0:
            try:
                obj, end = decoder.raw_decode(line, pos)
            except json.JSONDecodeError:  # a brace in a log record's text
                end = pos + 1
            else:
                if isinstance(obj, dict) and "rank" in obj:
                    found.append(obj)
            pos = line.find("{", end)
    return found


def _gone(pids: list[int]) -> bool:
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


# -- frameworks ------------------------------------------------------------------------------

_SENT = re.compile(r"rank (\d+): sent (\d+) bytes where a ring all-reduce sends (\d+) \((\d+) buckets through "
                   r"omnireduce, (\d+) failed\)")

FRAMEWORKS = {
    "lightning": [sys.executable, "examples/lightning_ddp.py"],
    "accelerate": [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "examples/accelerate_ddp.py"],
    "transformers": [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "examples/transformers_trainer.py"],
}


@pytest.mark.e2e  # each framework's example script, trained twice
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_trains_like_plain_ddp_with_its_own_aggregators(framework: str, tmp_path: Path) -> None:
    pytest.importorskip(framework)
    import torch

    cmd = FRAMEWORKS[framework]
    hooked = _start([*cmd, "--save", str(tmp_path / "hook.pt")])
    plain = _start([*cmd, "--plain", "--save", str(tmp_path / "plain.pt")])
    out, _ = _finish(hooked), _finish(plain)
    a, b = torch.load(tmp_path / "hook.pt"), torch.load(tmp_path / "plain.pt")
    assert a["final"].keys() == b["final"].keys()
    for k, v in a["final"].items():
        assert torch.allclose(v.float(), b["final"][k].float(), rtol=1e-5, atol=1e-6), f"{framework}: {k} differs"
    assert max((v.float() - a["initial"][k].float()).abs().max().item() for k, v in a["final"].items()) > 1e-4
    ranks = {int(m[1]): [int(x) for x in m.groups()[1:]] for m in _SENT.finditer(out)}
    assert sorted(ranks) == [0, 1], out[-3000:]
    for sent, dense, sparse, failed in ranks.values():
        assert sparse > 0 and failed == 0, out[-3000:]
        # path="measure" alternates between the paths for a bucket's first 8 steps, which is all of this
        # run (half the buckets start dense, half sparse): about half the bytes dense, the rest a few percent
        assert 0 < sent < 0.8 * dense, f"{framework}: the sparse path sent {sent} of {dense} bytes"


def test_lightning_strategy_is_a_ddp_strategy_and_pickles() -> None:
    pytest.importorskip("lightning")
    import pickle

    from lightning.pytorch.strategies import DDPStrategy

    from omnireduce.ddp import OmniReduceState
    from omnireduce.integrations import OmniReduceDDPStrategy

    strategy = OmniReduceDDPStrategy(find_unused_parameters=True)  # before torch.distributed: no error
    assert isinstance(strategy, DDPStrategy) and isinstance(strategy.omnireduce_state, OmniReduceState)
    clone = pickle.loads(pickle.dumps(strategy))  # as the spawn launcher does
    assert type(clone) is OmniReduceDDPStrategy and not clone.omnireduce_state.bound


# -- launchers -------------------------------------------------------------------------------

def _check_job(results: list[dict], world: int, nodes: int) -> None:
    assert sorted(r["rank"] for r in results) == list(range(world)), results
    for r in results:
        assert r["world"] == world and all(r["ok"]) and r["moved"] > 1e-3, r
        assert r["buckets_sparse"] > 0 and r["buckets_failed"] == 0 and r["sent_fraction"] < 0.5, r
        assert r["addresses"] == results[0]["addresses"], "ranks disagree about the aggregators"
    assert len(results[0]["addresses"]) == nodes
    by_node: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["rank"]):
        by_node.setdefault(r["node"], []).append(r)
    assert len(by_node) == nodes
    for members in by_node.values():  # the node's lowest rank started its one aggregator
        assert len(members[0]["aggregator_pids"]) == 1 and all(not m["aggregator_pids"] for m in members[1:])
    assert _gone([p for r in results for p in r["aggregator_pids"]]), "aggregators left running"


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("mpiexec", path=str(BIN)) is None, reason="mpiexec not installed (pip install mpich)")
def test_torchrun_two_nodes_and_mpiexec_at_once() -> None:
    """Two torchrun invocations (nodes of 2 and 1 ranks, c10d rendezvous on loopback), and an mpiexec
    job of 2 ranks on the same machine at the same time: no clash, no crosstalk."""
    port = free_port()
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
            f"colocated-{port}", "--max-restarts", "0"]
    nodes = [_start([*TORCHRUN, *rdzv, "--node-rank", str(n), "--nproc-per-node", str(2 - n), RANKED, "--steps", "5"])
             for n in (0, 1)]
    mpi = _start([str(BIN / "mpiexec"), "-n", "2", sys.executable, RANKED, "--steps", "5"])
    torchrun_results = [r for p in nodes for r in _json_lines(_finish(p))]
    mpi_results = _json_lines(_finish(mpi))
    _check_job(torchrun_results, world=3, nodes=2)
    _check_job(mpi_results, world=2, nodes=1)
    assert not set(torchrun_results[0]["addresses"]) & set(mpi_results[0]["addresses"])


def test_omnireduce_run_without_aggregator_addresses() -> None:
    out = _finish(_start([str(BIN / "omnireduce-run"), "--nproc", "2", RANKED, "--steps", "5"]))
    _check_job(_json_lines(out), world=2, nodes=1)


def test_a_killed_rank_takes_its_aggregator_along_and_the_others_fail_in_time() -> None:
    """Two "nodes" of one rank each (started directly, with torchrun's variables). Rank 1 is SIGKILLed
    between steps: its aggregator exits, and rank 0's next backward() raises within the timeout."""
    port, timeout = free_port(), 5.0
    procs = [_start([sys.executable, RANKED, "--kill-after", "2", "--timeout", str(timeout)], RANK=str(r),
                    WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GROUP_RANK=str(r))
             for r in (0, 1)]
    try:
        paused = []
        for p in procs:
            line = ""
            while not line.startswith("{"):
                line = p.stdout.readline()
                assert line or p.poll() is None, "a rank exited early"
            paused.append(_json_lines(line)[0])
        assert [len(r["aggregator_pids"]) for r in paused] == [1, 1], paused
        os.kill(paused[1]["pid"], signal.SIGKILL)
        _, alive = psutil.wait_procs([psutil.Process(p) for p in paused[1]["aggregator_pids"]], timeout=10)
        assert not alive, "the killed rank's aggregator is still running"
        out = _json_lines(_finish(procs[0], timeout=60))
        assert out, "rank 0 said nothing"
        error = out[-1]["error"]
        assert error and "omnireduce_hook failed at iteration 2" in error, out
        assert out[-1]["elapsed"] < timeout + 5, out
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    _, alive = psutil.wait_procs([psutil.Process(p) for p in paused[0]["aggregator_pids"] if psutil.pid_exists(p)],
                                 timeout=10)
    assert not alive, "rank 0's aggregator outlived it"


@pytest.mark.e2e
def test_one_node_per_network_namespace() -> None:
    """Each rank on a host of its own (a network namespace of ombench.netem, as root): each
    starts its node's aggregator on its own network address, and the other reaches it there."""
    from ombench import netem

    ok, why = netem.available()
    if not ok:
        pytest.skip(f"no emulated network here: {why}")
    with netem.Cluster(workers=2, aggregators=0, rate=None) as cluster:
        hosts = cluster.workers
        procs = [h.popen([sys.executable, RANKED, "--steps", "4"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", GROUP_RANK=str(r),
                                  MASTER_ADDR=hosts[0].address, MASTER_PORT="29500", GLOO_SOCKET_IFNAME=h.interface))
                 for r, h in enumerate(hosts)]
        results = [r for p in procs for r in _json_lines(_finish(p))]
    _check_job(results, world=2, nodes=2)
    for r, h in zip(sorted(results, key=lambda r: r["rank"]), hosts, strict=True):
        assert r["addresses"][r["rank"]].startswith(f"tcp://{h.address}:"), r  # its own host's address
