"""scripts/bench_hierarchy.py: the smallest configuration reports sane numbers.

On loopback (2 "nodes" by ``GROUP_RANK``, 2 ranks each; a few seconds) every method's sum matches
one computed here in float64 from the ranks' inputs (bench_allreduce.make_input, the benchmark's
workload), agrees with the Gloo ring's within 1e-5, and the library's byte counts are those of the
formulas (the hierarchy's in-node steps) or above zero. On an emulated network (root, skipped
without it) the veth counters see the Gloo ring's ``2 (W-1)/W`` of the tensor cross each node's
link, and the hierarchical dense baseline two thirds of that. :mod:`ombench.linkbytes` parses
``/proc/net/dev`` and :meth:`ombench.network.Network.rank_env` places ranks on nodes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_allreduce import make_input

from ombench import child_env, linkbytes, netem
from ombench.network import Network

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_hierarchy.py"
SIZE_MIB, BLOCK, DENSITY, SEED = 1.0, 256, 0.05, 1


def _run(tmp_path: Path, net: str) -> dict:
    cmd = [sys.executable, str(SCRIPT), "--nets", net, "--parts", "micro", "--size-mib", str(SIZE_MIB),
           "--densities", str(DENSITY), "--warmup", "1", "--iters", "2", "--seed", str(SEED), "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=child_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| hier. omnireduce |" in p.stdout  # the table was printed
    return json.loads((tmp_path / "hierarchy_2x2.json").read_text())


def test_loopback_two_nodes_of_two_sums_and_counts(tmp_path: Path) -> None:
    data = _run(tmp_path, "loopback")
    rows = {r["method"]: r for r in data["micro"]}
    assert list(rows) == ["ring", "hier-dense", "flat", "hier", "node-only"]
    partial = rows.pop("node-only")  # the node's sum only: not checked against the ring
    assert partial["agrees"] is None and partial["lib_across"] == 0
    numel = int(SIZE_MIB * 2**20) // 4
    expected = sum(make_input(r, numel, DENSITY, BLOCK, "random", SEED).astype(np.float64).sum() for r in range(4))
    shard = math.ceil(numel / 2 / BLOCK) * BLOCK * 4  # bytes of one local rank's shard
    for name, r in rows.items():
        assert r["topology"] == "2 node(s) x 2 rank(s)"
        assert r["agrees"] and r["max_abs_diff_vs_ring"] <= 1e-5, name
        assert r["checksum"] == pytest.approx(expected, abs=1e-2), name
        assert r["median_s"] > 0 and r["link"] is None  # loopback: no node link to count
        assert r["lib_across"] > 0, name
    assert rows["ring"]["lib_across"] == pytest.approx(2 * 1.5 * numel * 4)  # two ranks' ring figure per node
    for r in (rows["hier-dense"], rows["hier"], partial):  # reduce-scatter + all-gather: 2 (L-1) shards x 2 ranks
        assert r["lib_in_node"] == 2 * 2 * shard
    assert rows["flat"]["lib_in_node"] == 0
    # the omnireduce methods send only non-zero blocks: far less than the dense rail's ring of the shard
    assert rows["hier"]["lib_across"] < rows["hier-dense"]["lib_across"] / 4
    assert 0 < data["micro"][0]["node_union"] < data["micro"][0]["global_union"] < 1


@pytest.mark.e2e  # network namespaces, the benchmark's whole micro part
def test_emulated_links_count_what_crosses_them(tmp_path: Path) -> None:
    ok, why = netem.available()
    if not ok:
        pytest.skip(f"network emulation unavailable: {why}")
    rows = {r["method"]: r for r in _run(tmp_path, "10gbit")["micro"]}
    tensor = int(SIZE_MIB * 2**20)
    assert rows["node-only"]["link"]["busiest"] < 0.01 * tensor  # its steps stay inside the nodes
    for name, r in rows.items():
        assert r["agrees"] is not False, name
        link = r["link"]
        assert len(link["up_per_node"]) == 2 and link["busiest"] > 0, name
    # Gloo's ring over ranks 0-1-2-3 crosses each node link once each way: 2 (W-1)/W of the tensor, plus headers
    assert 1.5 * tensor <= rows["ring"]["link"]["busiest"] <= 1.5 * tensor * 1.1
    assert 1.0 * tensor <= rows["hier-dense"]["link"]["busiest"] <= 1.0 * tensor * 1.1
    assert rows["hier"]["link"]["busiest"] < rows["flat"]["link"]["busiest"]


def test_proc_net_dev_is_parsed(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive                            |  Transmit\n"
                   " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets\n"
                   "    lo:  1000      10    0    0    0     0          0         0     1000      10 0 0 0 0 0 0\n"
                   "ornet0: 123456   100    0    0    0     0          0         0   654321     200 0 0 0 0 0 0\n")
    assert linkbytes.read("ornet0", dev) == linkbytes.Counters(rx=123456, tx=654321)
    with pytest.raises(KeyError):
        linkbytes.read("eth9", dev)
    deltas = linkbytes.per_node([(1, linkbytes.Counters(5, 6)), (0, linkbytes.Counters(1, 2)),
                                 (0, linkbytes.Counters(9, 9)), (1, None)])
    assert deltas == [linkbytes.Counters(1, 2), linkbytes.Counters(5, 6)]
    assert linkbytes.summary(deltas, 2) == {"up_per_node": [1.0, 3.0], "down_per_node": [0.5, 2.5],
                                            "up_mean": 2.0, "down_mean": 1.5, "busiest": 3.0}
    assert linkbytes.per_node([(0, None)]) is None


def test_loopback_network_places_ranks_on_nodes() -> None:
    with Network("loopback", 6, 0, ranks_per_node=3) as net:
        assert net.nodes == 2 and [net.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
        env = net.rank_env(4)
        assert env["GROUP_RANK"] == "1" and env["LOCAL_RANK"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert "OMBENCH_LINK" not in env  # loopback has no node link
    with Network("loopback", 2, 0) as net:
        assert net.rank_env(1) == {}  # one rank per node: as before
    with pytest.raises(ValueError):
        Network("loopback", 5, 0, ranks_per_node=2)
