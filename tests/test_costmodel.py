"""The all-reduce cost model (ombench.costmodel) against arithmetic done by hand.

No processes, no timing: every expected number below is worked out in the comments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ombench import costmodel as cm
from ombench import hiercost as hc
from ombench import hierpredict
from ombench.traffic import colocated_link_bytes, omnireduce_link_bytes
from omnireduce.blocks import Layout

# 24 elements in blocks of 4: 6 blocks of 16 bytes. With at most 2 lanes per slot and 3 slots (a
# tensor of 6 blocks needs 3), block b is in lane b, slot b div 2: slot 0 = blocks 0,1; slot 1 =
# blocks 2,3; slot 2 = blocks 4,5. With A = 2: aggregator 0 has slots 0 and 2 (blocks 0,1,4,5),
# aggregator 1 has slot 1 (blocks 2,3).
NUMEL, BLOCK, LANES = 24, 4, 2
MASKS = np.array([[1, 0, 1, 0, 1, 0],   # rank 0: blocks 0, 2, 4
                  [1, 1, 0, 0, 0, 0]],  # rank 1: blocks 0, 1      -> union 0, 1, 2, 4
                 dtype=bool)
R = 1000.0  # bytes per second


def test_layout_of_the_small_tensor() -> None:
    lay = Layout.for_tensor(NUMEL, BLOCK, LANES, 4)
    assert (lay.lanes, lay.slots, lay.rows) == (2, 3, 1)


@pytest.mark.parametrize("W, expected", [(2, 1.0), (4, 1.5), (8, 1.75), (64, 2 * 63 / 64)])
def test_ring_floor(W: int, expected: float) -> None:
    # 2 (W-1)/W of the tensor over each rank's link
    assert cm.ring_floor(1e9, W, 1e9) == pytest.approx(expected)
    assert cm.ring_floor(1e9, 1, 1e9) == 0.0


def test_zero_cpu_omnireduce_wire_time_by_hand() -> None:
    # payload by hand: rank 0 up 3 blocks = 48, down the union 4 blocks = 64; rank 1 up 32, down 64;
    # aggregator 0 down: rank 0's {0, 4} + rank 1's {0, 1} = 64; up: 2 ranks x union {0, 1, 4} = 96;
    # aggregator 1 down: rank 0's {2} = 16; up: 2 x {2} = 32.
    t = cm.omnireduce_traffic(MASKS, NUMEL, BLOCK, 2, lanes=LANES, headers=False)
    by_hand = {"w0 up": 48, "w0 down": 64, "w1 up": 32, "w1 down": 64,
               "a0 down": 64, "a0 up": 96, "a1 down": 16, "a1 up": 32}
    assert t.links == by_hand == omnireduce_link_bytes(MASKS, NUMEL, BLOCK, 2, LANES, 4)
    # the up phase carries the blocks (ranks' up, aggregators' down), the down phase the sums
    assert max(t.up_links.values()) == 64 and max(t.down_links.values()) == 96
    assert t.slots_per_aggregator == 1  # aggregator 1 holds one slot: no pipelining
    p = cm.omnireduce_time(t, cm.CostParams(), cm.Machine(rate_bytes_s=R))
    # zero CPU: the busiest link of the up phase, then the busiest of the down phase
    assert p.time_s == pytest.approx((64 + 96) / R)
    assert p.bound == "phases (link)"
    assert t.round_trips == 1
    # more slots per aggregator pipeline the phases: with k slots the down phase overlaps all but
    # 1/k of the up phase, and the busiest link (96 bytes) is what is left as k grows
    for k, expected in [(2, 96 + 64 / 2), (4, 96 + 64 / 4)]:
        tk = dataclasses.replace(t, slots_per_aggregator=k)
        assert cm.omnireduce_time(tk, cm.CostParams(), cm.Machine(rate_bytes_s=R)).time_s == pytest.approx(expected / R)
    huge = dataclasses.replace(t, slots_per_aggregator=10**9)
    assert cm.omnireduce_time(huge, cm.CostParams(), cm.Machine(rate_bytes_s=R)).time_s == pytest.approx(96 / R)


def test_zero_cpu_omnireduce_with_headers() -> None:
    # each message carries a 64-byte header and a 1-byte bitmap of its slot's 2 lanes: 65 bytes.
    # aggregator 0 answers 2 ranks for each of its 2 slots: 4 messages; 96 + 4 * 65 = 356 bytes down
    # phase; up phase: aggregator 0 receives 64 + 4 * 65 = 324.
    t = cm.omnireduce_traffic(MASKS, NUMEL, BLOCK, 2, lanes=LANES)
    assert t.links["a0 up"] == 96 + 4 * 65
    assert t.links["w0 up"] == 48 + 3 * 65  # one message per slot
    p = cm.omnireduce_time(t, cm.CostParams(), cm.Machine(rate_bytes_s=R, latency_s=0.01))
    assert p.time_s == pytest.approx((324 + 356) / R + 2 * 0.01)  # one round trip
    assert t.rank_messages.tolist() == [3, 3]  # each way
    assert t.agg_messages.tolist() == [4, 2]


def test_zero_cpu_colocated_by_hand() -> None:
    # A = W = 2, slots max(4, 2) = 4 -> still 3 slots: host 0 owns blocks 0,1,4,5, host 1 blocks 2,3.
    # up phase:   host 0 up: rank 0's blocks for host 1, {2} = 16; host 0 down: rank 1's for host 0, {0, 1} = 32;
    #             host 1 up: rank 1's for host 0, {0, 1} = 32; host 1 down: rank 0's for host 1, {2} = 16.
    # down phase: host 0 up: its sums {0, 1, 4} to 1 other rank = 48; host 0 down: host 1's sums {2} = 16;
    #             host 1 up: {2} to 1 other rank = 16; host 1 down: host 0's sums {0, 1, 4} = 48.
    t = cm.omnireduce_traffic(MASKS, NUMEL, BLOCK, 0, lanes=LANES, colocated=True, headers=False)
    assert t.up_links == {"host0 up": 16, "host0 down": 32, "host1 up": 32, "host1 down": 16}
    assert t.down_links == {"host0 up": 48, "host0 down": 16, "host1 up": 16, "host1 down": 48}
    # the phases add up to traffic.py's colocated figure
    assert t.links == colocated_link_bytes(MASKS, NUMEL, BLOCK, LANES, 4) == {
        "host0 up": 64, "host0 down": 48, "host1 up": 48, "host1 down": 64}
    p = cm.omnireduce_time(t, cm.CostParams(), cm.Machine(rate_bytes_s=R))
    assert p.time_s == pytest.approx((32 + 48) / R)  # host 1 holds one slot: no pipelining
    # the processes still exchange every byte: each rank sends its blocks, each aggregator its sums
    assert t.rank_sent.tolist() == [48, 32]
    assert t.agg_sent.tolist() == [96, 32]


def test_colocated_phases_add_up_for_random_masks() -> None:
    rng = np.random.default_rng(5)
    numel, block = 40_000 * 16, 16
    masks = cm.random_masks(5, 40_000, 0.07, rng)
    t = cm.omnireduce_traffic(masks, numel, block, 0, lanes=512, colocated=True, headers=False)
    expected = colocated_link_bytes(masks, numel, block, 512, 5)
    assert t.links == pytest.approx(expected)


def test_fair_share() -> None:
    # one process of 10 s and three of 1 s on 2 cores: 4 runnable, half a core each, for 2 s (the
    # small ones finish); then the big one alone at a full core for its remaining 9 s: 11 s, above
    # the total / cores (6.5) and the largest (10)
    assert cm.fair_share([10, 1, 1, 1], 2) == pytest.approx(11.0)
    assert cm.fair_share([3, 3, 3, 3], 2) == pytest.approx(6.0)
    assert cm.fair_share([3, 1], 2) == pytest.approx(3.0)  # a core each
    assert cm.fair_share([3, 1], None) == 3.0
    assert cm.fair_share([], 2) == 0.0


def test_cpu_terms_and_shared_cores() -> None:
    # 4096 blocks of 256 fp32 (4.194304 MB): 4 slots of 1024 lanes. Scan 2 ms per MB per rank (8.39 ms);
    # rank per-op 2 ms + 1 ms per message; no aggregator cost; no block is non-zero, but every slot
    # still makes its trip: 4 messages each way.
    numel = 4096 * 256
    scan = 2e-3 * 4.194304
    masks = np.zeros((4, 4096), dtype=bool)
    t = cm.omnireduce_traffic(masks, numel, 256, 1, headers=False)
    assert t.rank_messages.tolist() == [4, 4, 4, 4]
    assert t.slots_per_aggregator == 4
    p = cm.CostParams(rank=cm.RankCost(per_op_s=2e-3, per_message_s=1e-3, scan_per_mb_s=2e-3))
    own = cm.omnireduce_time(t, p, cm.Machine())
    # the scan, then 5 ms up and 5 ms down per rank: pipelined over 4 slots 5 + 5/4 = 6.25 ms < the
    # rank's 10 ms of CPU in all
    assert own.time_s == pytest.approx(scan + 10e-3)
    assert own.bound == "rank"
    assert own.terms["scan"] == pytest.approx(scan) and own.terms["rank"] == pytest.approx(10e-3)
    shared = cm.omnireduce_time(t, p, cm.Machine(cores=2))
    # 4 scans on 2 cores, then 4 ranks x 10 ms on 2 cores (the aggregator has nothing to do)
    assert shared.time_s == pytest.approx(2 * scan + 20e-3)
    assert shared.bound == "shared cores"


def test_the_whole_scan_comes_before_the_up_phase() -> None:
    # the small tensor (3 one-round slots) with a scan of 30 s per MB (96 bytes: 2.88 ms per rank)
    # and no other CPU cost, at 1000 B/s: the up phase's 64 ms of link leave the ranks' cores idle,
    # yet nothing is sent before the scan ends, so the whole scan comes first: 2.88 ms, then the up
    # phase's 64 ms and the down phase's 96 ms (one slot per aggregator 1: no pipelining)
    p = cm.CostParams(rank=cm.RankCost(scan_per_mb_s=30.0))
    t = cm.omnireduce_traffic(MASKS, NUMEL, BLOCK, 2, lanes=LANES, headers=False)
    pr = cm.omnireduce_time(t, p, cm.Machine(rate_bytes_s=R))
    assert pr.terms["scan"] == pytest.approx(2.88e-3)
    assert pr.terms["up"] == pytest.approx(64 / R) and pr.terms["down"] == pytest.approx(96 / R)
    assert pr.terms["rank"] == 0.0  # the scan is not part of the phases' CPU
    assert pr.time_s == pytest.approx(2.88e-3 + (64 + 96) / R)
    # the two ranks' scans on one core: 5.76 ms before anything is sent
    one_core = cm.omnireduce_time(t, p, cm.Machine(rate_bytes_s=R, cores=1))
    assert one_core.terms["scan"] == pytest.approx(5.76e-3)
    assert one_core.time_s == pytest.approx(5.76e-3 + (64 + 96) / R)


def test_ring_time() -> None:
    p = cm.CostParams(ring=cm.RingCost(per_op_s=0.0, per_mb_s=1e-3))
    # W = 4, 100 MB: 150 MB per rank -> 150 ms of CPU; 4 ranks on 2 cores: 300 ms
    assert cm.ring_time(100e6, 4, p, cm.Machine(cores=2)).time_s == pytest.approx(0.3)
    # one core each, 1 GB/s links: link 150 ms = CPU 150 ms; plus 2 (W-1) latencies of 1 ms
    assert cm.ring_time(100e6, 4, p, cm.Machine(rate_bytes_s=1e9, latency_s=1e-3)).time_s == pytest.approx(0.156)


def test_many_rows_per_lane_needs_rounds() -> None:
    # 16 blocks, 2 lanes per slot, 2 slots: 4 lanes, 4 rows each. Dense: every slot runs 4 data
    # rounds after its bootstrap: 5 messages each way per slot, 5 round trips.
    masks = np.ones((3, 16), dtype=bool)
    t = cm.omnireduce_traffic(masks, 64, 4, 1, lanes=2, slots=2, headers=False)
    assert t.round_trips == 5
    assert t.rank_messages.tolist() == [10, 10, 10]  # each way, 2 slots


def test_random_masks_counts_and_union() -> None:
    rng = np.random.default_rng(3)
    m = cm.random_masks(8, 100_000, 0.05, rng)
    assert m.sum(axis=1).tolist() == [5000] * 8
    assert m.any(axis=0).mean() == pytest.approx(1 - 0.95**8, abs=0.005)
    assert cm.random_masks(2, 10, 1.0, rng).all()
    assert cm.random_masks(3, 10, [0, 3, 10], rng).sum(axis=1).tolist() == [0, 3, 10]


def test_crossover_density() -> None:
    # omnireduce 100 d ms against a 10 ms ring: they cross at d = 0.1, which is not on the grid;
    # log(omni / ring) is linear in log(d), so the interpolation is exact
    ds = [1.0, 0.3, 0.03, 0.003]
    x = cm.crossover_density(ds, [100 * d for d in ds], [10.0] * 4)
    assert x == pytest.approx(0.1)
    assert cm.crossover_density(ds, [1.0] * 4, [10.0] * 4) is None  # faster everywhere
    assert cm.crossover_density(ds, [100.0] * 4, [10.0] * 4) is None  # faster nowhere
    # the first crossing from below, whatever the order of the grid
    assert cm.crossover_density(ds[::-1], [100 * d for d in ds[::-1]], [10.0] * 4) == pytest.approx(0.1)


def test_nonnegative_lstsq() -> None:
    X = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert cm.nonnegative_lstsq(X, X @ [2.0, 3.0]).tolist() == pytest.approx([2.0, 3.0])
    b = cm.nonnegative_lstsq(X, np.array([1.0, -1.0, 0.0]))  # unconstrained: (1, -1)
    assert b[1] == 0.0 and b[0] > 0


TRUE = cm.CostParams(rank=cm.RankCost(per_op_s=2e-3, per_message_s=80e-6, per_mb_sent_s=0.3e-3,
                                      per_mb_received_s=0.5e-3, scan_per_mb_s=0.1e-3),
                     aggregator=cm.AggregatorCost(per_op_s=1e-3, per_message_s=50e-6, per_mb_received_s=0.2e-3,
                                                  per_mb_sent_s=0.4e-3),
                     ring=cm.RingCost(per_op_s=5e-3, per_mb_s=0.6e-3))


def _synthetic_run(W: int, A: int, size_mib: float, slots: int | None, lanes: int | None,
                   densities: list[float], true: cm.CostParams = TRUE,
                   rate_bps: float | None = None) -> tuple[dict, list[dict]]:
    """A bench_allreduce file whose CPU columns follow ``true`` exactly, computed here by hand."""
    numel = int(size_mib * (1 << 20)) // 4
    argv = ["bench_allreduce.py", "--loopback"] + (["--slots", str(slots)] if slots else []) + (
        ["--lanes", str(lanes)] if lanes else [])
    meta = {"workers": W, "numel": numel, "block": 256, "argv": argv, "rate_bps": rate_bps,
            "net": "1gbit" if rate_bps else "loopback", "size_mib": size_mib}
    lay = Layout.for_tensor(numel, 256, lanes or 32768, slots or max(4, A))
    assert lay.one_round
    over = 64 + math.ceil(lay.lanes / 8)  # header + bitmap per message
    nb, N = lay.num_blocks, numel * 4 / 1e6
    r, a, g = true.rank, true.aggregator, true.ring
    rows = []
    for d in densities:
        k = int(nb * d)
        union = min(nb, round(nb * (1 - (1 - d) ** W)))
        msgs_sent = lay.slots  # per rank: one per slot
        sent = (W * k * 1024 + W * msgs_sent * over) / 1e6  # all ranks, MB
        recv = (W * union * 1024 + W * msgs_sent * over) / 1e6
        msgs = 2 * W * msgs_sent
        rank_cpu = W * (r.per_op_s + r.scan_per_mb_s * N) + r.per_message_s * msgs + r.per_mb_sent_s * sent \
            + r.per_mb_received_s * recv
        agg_cpu = min(A, lay.slots) * a.per_op_s + a.per_message_s * msgs + a.per_mb_received_s * sent \
            + a.per_mb_sent_s * recv
        rows.append({"method": "omnireduce", "label": "omnireduce", "aggregators": A, "density": d, "median_s": 1.0,
                     "worker_cpu_s_per_op": rank_cpu, "aggregator_cpu_s_per_op": agg_cpu,
                     "scan_floor_cpu_s": W * r.scan_per_mb_s * N, "blocks_nonzero": [k] * W, "blocks_union": union,
                     "messages_sent_per_op": msgs_sent})
        ring_mb = 2 * (W - 1) / W * N
        rows.append({"method": "gloo", "label": "gloo", "density": d, "median_s": 1.0,
                     "worker_cpu_s_per_op": W * (g.per_op_s + g.per_mb_s * ring_mb)})
    return meta, rows


def test_fit_recovers_known_parameters() -> None:
    obs = []
    for W, A, size, slots, lanes in [(2, 1, 100, None, None), (4, 1, 100, None, None), (8, 1, 100, None, None),
                                     (4, 1, 4, 16, 256), (4, 1, 4, 64, 64), (4, 2, 25, None, None)]:
        meta, rows = _synthetic_run(W, A, size, slots, lanes, [1.0, 0.4, 0.1, 0.01])
        obs += [o for r in rows if (o := cm.observation(r, meta)) is not None]
    got = cm.fit(obs)
    for part in ("rank", "aggregator", "ring"):
        want, have = getattr(TRUE, part), getattr(got, part)
        for f in want.__dataclass_fields__:
            assert getattr(have, f) == pytest.approx(getattr(want, f), rel=1e-6), (part, f)
    for o in obs:  # and the fitted model gives back the CPU columns
        ranks, _ = cm.observation_cpu(o, got)
        assert ranks == pytest.approx(o.rank_cpu_s, rel=1e-9)


def test_observation_reads_a_bench_row() -> None:
    meta, rows = _synthetic_run(4, 1, 100, None, None, [0.1])
    o = cm.observation(rows[0], meta)
    assert o is not None
    assert (o.method, o.workers, o.aggregators, o.rank_messages) == ("omnireduce", 4, 1, 32)  # 4 slots x 2 x 4
    assert o.rate_bytes_s == math.inf
    assert cm.observation({"method": "mpi", "density": 1.0, "median_s": 1.0, "worker_cpu_s_per_op": 1.0}, meta) is None


def test_fit_paths_shares_the_python_costs() -> None:
    # the network path: other costs per MB (and scan), the same per-op and per-message costs; its
    # runs have a single layout (4 slots), so only the loopback runs can separate those two
    net = dataclasses.replace(
        TRUE,
        rank=dataclasses.replace(TRUE.rank, per_mb_sent_s=0.9e-3, per_mb_received_s=1.1e-3, scan_per_mb_s=0.12e-3),
        aggregator=dataclasses.replace(TRUE.aggregator, per_mb_received_s=0.7e-3, per_mb_sent_s=0.25e-3),
        ring=dataclasses.replace(TRUE.ring, per_mb_s=0.8e-3))
    obs = []
    for W, A, size, slots, lanes in [(2, 1, 100, None, None), (4, 1, 100, None, None), (8, 1, 100, None, None),
                                     (4, 1, 4, 16, 256), (4, 1, 4, 64, 64)]:
        meta, rows = _synthetic_run(W, A, size, slots, lanes, [1.0, 0.4, 0.1, 0.01])
        obs += [o for r in rows if (o := cm.observation(r, meta)) is not None]
    for W in (4, 2):
        meta, rows = _synthetic_run(W, 1, 25, None, None, [1.0, 0.4, 0.1, 0.01], true=net, rate_bps=1e9)
        obs += [o for r in rows if (o := cm.observation(r, meta)) is not None]
    got = cm.fit_paths(obs)
    assert set(got) == {"loopback", "network"}
    for path, want_all in (("loopback", TRUE), ("network", net)):
        for part in ("rank", "aggregator", "ring"):
            want, have = getattr(want_all, part), getattr(got[path], part)
            for f in want.__dataclass_fields__:
                assert getattr(have, f) == pytest.approx(getattr(want, f), rel=1e-6), (path, part, f)


# --------------------------------------------------------------------------------------------
# nodes of several GPUs (ombench.hiercost): the hierarchy against the hierarchical ring


def test_union_density() -> None:
    # two ranks at 10%: a block is empty in both with probability 0.9^2 = 0.81
    assert hc.union_density(0.1, 2) == pytest.approx(0.19)
    assert hc.union_density(0.3, 1) == pytest.approx(0.3)
    assert hc.union_density(1.0, 5) == 1.0 and hc.union_density(0.0, 5) == 0.0
    grid = [0.001, 0.01, 0.1, 0.5]
    for k in (1, 2, 8, 64):
        vals = [hc.union_density(d, k) for d in grid]
        assert vals == sorted(vals) and all(v >= d - 1e-12 for v, d in zip(vals, grid, strict=True))
        assert hc.union_density(0.01, k + 1) > hc.union_density(0.01, k)


def test_densities_of_rails_and_flat_jobs() -> None:
    c = hc.Cluster(nodes=4, nic_bytes_s=1.0, gpus=8)
    # a rail member sends its node's sum (8 GPUs); the rail's union is that of all 32 ranks
    sent, union = hc.densities(0.01, c, "independent", hierarchical=True)
    assert sent == pytest.approx(1 - 0.99 ** 8) and union == pytest.approx(1 - 0.99 ** 32)
    assert sent > 0.01  # the node's sum is at least as dense as one GPU
    assert hc.densities(0.01, c, "independent", hierarchical=False) == pytest.approx((0.01, 1 - 0.99 ** 32))
    assert hc.densities(0.01, c, "overlapping", hierarchical=True) == (0.01, 0.01)
    with pytest.raises(ValueError):
        hc.densities(0.01, c, "clustered", hierarchical=True)


def test_hierarchical_ring_floor_by_hand() -> None:
    # 4 nodes of 4 GPUs, 8 GB: reduce-scatter 3/4 x 8e9 / 1e10 = 0.6 s; the shard (2e9) in a ring of
    # 4 over 1 GB/s NICs: 2 x 3/4 x 2e9 / 1e9 = 3 s; all-gather 0.6 s
    c = hc.Cluster(nodes=4, nic_bytes_s=1e9, gpus=4, nvlink_bytes_s=1e10)
    p = hc.hierarchical_ring_floor(8e9, c)
    assert p.terms == pytest.approx({"reduce-scatter": 0.6, "cross": 3.0, "all-gather": 0.6})
    assert p.time_s == pytest.approx(4.2)
    # one node: no network step; one GPU per node: the flat ring floor
    assert hc.hierarchical_ring_floor(8e9, dataclasses.replace(c, nodes=1)).time_s == pytest.approx(1.2)
    one = dataclasses.replace(c, gpus=1)
    assert hc.hierarchical_ring_floor(8e9, one).time_s == pytest.approx(cm.ring_floor(8e9, 4, 1e9))
    # more nodes cost more, towards 2 n/G / R
    floors = [hc.hierarchical_ring_floor(8e9, dataclasses.replace(c, nodes=n)).terms["cross"] for n in (2, 4, 8, 64)]
    assert floors == sorted(floors) and floors[-1] < 2 * 2e9 / 1e9


# 2 nodes of 2 GPUs, a 64-element buffer in blocks of 4 (16 bytes): shards of 32 elements = 8 blocks,
# with 2 lanes per slot: 4 slots of 2 blocks (32 bytes) each.
SMALL = {"numel": 64, "block": 4, "lanes": 2, "headers": False}


def test_rails_spread_over_the_aggregators_by_hand() -> None:
    # spread: 2 aggregators per node (a0, a1 on node 0's NICs 0, 1; a2, a3 on node 1's), rail j's slot s
    # at aggregator (s + 2j) mod 4: rail 0 -> a0 a1 a2 a3, rail 1 -> a2 a3 a0 a1. Every aggregator
    # holds one slot of each rail; every member has 2 of its 4 slots on the other node (64 bytes).
    c = hc.Cluster(nodes=2, nic_bytes_s=1000.0, gpus=2, nvlink_bytes_s=1e4, latency_s=0.0)
    s = hc.jobs_structure(c, True, **SMALL)
    assert s.tensor_bytes == 128 and s.rank_blocks.tolist() == [128] * 4
    assert s.agg_ops.tolist() == [2] * 4 and s.agg_slots.tolist() == [2] * 4
    # each aggregator's 2 slots: 2 members each, 32 bytes per slot: 128 bytes at density 1
    assert s.agg_up_blocks.tolist() == [128] * 4
    for nic in (s.nic_up_out, s.nic_up_in, s.nic_down_out, s.nic_down_in):
        assert nic.tolist() == [64] * 4  # one remote member per slot, 2 slots per aggregator
    # no CPU, dense: up 64 / R, down 64 / R, pipelined over 2 slots: 64 + 32 = 96 bytes' time; but
    # a NIC's outgoing direction carries its rank's 64 bytes up and its aggregator's 64 down: 128,
    # as much as the ring's 2 x 1/2 x 128 (reduce-scatter and all-gather: 1/2 x 256 / 1e4 each)
    pr = hc.hierarchical_omnireduce(256.0, s, 1.0, "overlapping", cm.CostParams(), c)
    assert pr.terms["cross"] == pytest.approx(0.128) and pr.bound == "link"
    assert pr.time_s == pytest.approx(2 * 0.0128 + 0.128)
    assert hc.hierarchical_ring_floor(256.0, c).time_s == pytest.approx(2 * 0.0128 + 0.128)
    # a quarter of the blocks up, all down: phases max(16, 64) + 16 / 2 = 72 < link 16 + 64 = 80
    assert hc.jobs_time(s, 0.25, 1.0, cm.CostParams(), c).time_s == pytest.approx(0.080)
    # an eighth of the blocks both ways: phases 8 + 8 / 2 = 12 < link 8 + 8 = 16
    t = hc.jobs_time(s, 0.125, 0.125, cm.CostParams(), c)
    assert t.time_s == pytest.approx(0.016) and t.bound == "link"


def test_rails_as_coded_share_the_first_aggregators_by_hand() -> None:
    # as coded: 1 aggregator per node (a0 on node 0, a1 on node 1), both on NIC 0; every rail's slot s
    # at aggregator s mod 2: a0 holds slots 0, 2 of both rails (4 slots, 2 ops)
    c = hc.Cluster(nodes=2, nic_bytes_s=1000.0, gpus=2, nvlink_bytes_s=1e4, latency_s=0.0, spread=False)
    s = hc.jobs_structure(c, True, **SMALL)
    assert s.agg_ops.tolist() == [2, 2] and s.agg_slots.tolist() == [4, 4]
    # NIC 0 of each node carries its rank's 64 remote bytes and its aggregator's 4 slots x 1 remote
    # member x 32 bytes = 128; NIC 1 only its rank's 64
    assert s.nic_up_out.tolist() == [64, 64, 64, 64]
    assert s.nic_up_in.tolist() == [128, 0, 128, 0]
    # no CPU, dense: NIC 0 sends 64 up and its aggregator's 128 down: 192 bytes' time (the phases,
    # 128 + 128 / 4 = 160, are shorter); spread, the same rails took 128
    assert hc.jobs_time(s, 1.0, 1.0, cm.CostParams(), c).time_s == pytest.approx(0.192)


def test_expected_traffic_matches_random_masks() -> None:
    # one GPU per node, one aggregator per node: flat omnireduce is the colocated model of costmodel,
    # whose bytes come from real masks. 4 ranks, 4096 blocks of 256 elements, 1024 each at random.
    N, block, numel, d = 4, 256, 4096 * 256, 0.25
    masks = cm.random_masks(N, numel // block, d, np.random.default_rng(1))
    t = cm.omnireduce_traffic(masks, numel, block, N, colocated=True)
    c = hc.Cluster(nodes=N, nic_bytes_s=1e9, gpus=1, latency_s=25e-6, spread=False)
    s = hc.jobs_structure(c, False, numel, block)
    union = float(masks.any(axis=0).mean())  # realised; expected 1 - 0.75^4 = 0.68
    assert union == pytest.approx(hc.union_density(d, N), rel=0.03)
    b = s.at(d, union)
    assert b["rank_sent"] == pytest.approx(t.rank_sent)  # exact: every rank sends 1024 blocks
    assert b["rank_received"] == pytest.approx(t.rank_received)  # exact given the union
    assert s.rank_messages == pytest.approx(t.rank_messages)
    assert b["agg_received"] == pytest.approx(t.agg_received, rel=0.05)  # random per slot
    assert b["agg_sent"] == pytest.approx(t.agg_sent, rel=0.05)
    masks_up = [t.up_links[f"host{h} up"] for h in range(N)] + [t.up_links[f"host{h} down"] for h in range(N)]
    masks_down = [t.down_links[f"host{h} up"] for h in range(N)] + [t.down_links[f"host{h} down"] for h in range(N)]
    assert b["nic_up"] == pytest.approx(masks_up, rel=0.05)
    assert b["nic_down"] == pytest.approx(masks_down, rel=0.05)
    p = cm.CostParams(rank=cm.RankCost(2e-3, 2e-4, 1e-4, 1.3e-3, 9e-5), aggregator=cm.AggregatorCost(2e-3, 1.5e-4,
                                                                                                     5e-4, 6e-4))
    m = cm.Machine(rate_bytes_s=1e9, latency_s=25e-6)
    for q in (p, cm.CostParams()):
        assert hc.jobs_time(s, d, union, q, c).time_s == pytest.approx(cm.omnireduce_time(t, q, m).time_s, rel=0.03)


FITTED = cm.CostParams(rank=cm.RankCost(2.2e-3, 2e-4, 0.0, 1.35e-3, 9e-5),
                       aggregator=cm.AggregatorCost(2.2e-3, 1.5e-4, 5e-4, 6.3e-4))


@pytest.mark.parametrize("spread", [True, False])
def test_hierarchy_monotone_in_density(spread: bool) -> None:
    grid = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 0.5]
    for N in (2, 8):
        c = hc.Cluster(nodes=N, nic_bytes_s=hc.gbit(100), spread=spread)
        s = hc.jobs_structure(c, True, 4 << 20, 256)
        f = hc.jobs_structure(c, False, 4 << 20, 256)
        for p in (FITTED, cm.CostParams()):
            for placement in hc.PLACEMENTS:
                times = [hc.hierarchical_omnireduce(16e6, s, d, placement, p, c).time_s for d in grid]
                assert times == sorted(times)
                flat = [hc.flat_omnireduce(f, d, placement, p, c).time_s for d in grid]
                assert flat == sorted(flat)
            # the node's sum grows with the union; overlapping blocks never cost more
            for d in grid:
                assert (hc.hierarchical_omnireduce(16e6, s, d, "overlapping", p, c).time_s
                        <= hc.hierarchical_omnireduce(16e6, s, d, "independent", p, c).time_s)


def test_hierarchy_moves_less_per_nic_than_flat() -> None:
    # spread, no CPU: a NIC carries a shard's blocks (n / G) instead of the whole buffer's
    for N in (2, 4, 8):
        c = hc.Cluster(nodes=N, nic_bytes_s=hc.gbit(100))
        s = hc.jobs_structure(c, True, 4 << 20, 256)
        f = hc.jobs_structure(c, False, 4 << 20, 256)
        for d in (0.01, 0.1, 0.5):
            assert (hc.jobs_time(s, d, d, cm.CostParams(), c).time_s
                    < hc.flat_omnireduce(f, d, "overlapping", cm.CostParams(), c).time_s)
            assert s.at(d, d)["nic_up"].max() < f.at(d, d)["nic_up"].max() / 2


def test_scaled_costs() -> None:
    half = hc.scaled(FITTED, 0.5)
    assert half.rank.per_message_s == pytest.approx(1e-4) and half.aggregator.per_mb_sent_s == pytest.approx(3.15e-4)
    c = hc.Cluster(nodes=4, nic_bytes_s=1e15, nvlink_bytes_s=1e15, latency_s=0.0)  # CPU-bound
    s = hc.jobs_structure(c, True, 4 << 20, 256)
    assert hc.jobs_time(s, 0.1, 0.3, half, c).time_s == pytest.approx(hc.jobs_time(s, 0.1, 0.3, FITTED, c).time_s / 2)


def test_hierarchy_sweep_crossovers_and_labels() -> None:
    setting = hierpredict.Setting(size_mib=4, nodes=(2, 8), rates_gbit=(100,), grid=7)
    res = hierpredict.sweep({"network": FITTED}, "network", setting)
    fine = setting.fine()
    for cross in res["crossovers"]:
        c = hc.Cluster(nodes=cross["nodes"], nic_bytes_s=hc.gbit(100), spread=cross["deployment"] == "spread")
        s = hc.jobs_structure(c, True, setting.numel, setting.block)
        ring = hc.hierarchical_ring_floor(setting.numel * 4.0, c).time_s
        wire = [hc.hierarchical_omnireduce(setting.numel * 4.0, s, d, cross["placement"], cm.CostParams(), c).time_s
                for d in fine]
        x = cross["hier omnireduce (wire)"]
        faster = [d for d, t in zip(fine, wire, strict=True) if t < ring]
        assert x["always"] == (len(faster) == len(fine)) and x["never"] == (not faster)
        if x["density"] is not None:  # between the last density that wins and the next one up
            below = max(faster)
            above = min(d for d in fine if d > below)
            assert below <= x["density"] <= above
    assert len(res["rows"]) == 2 * 2 * (1 + 2 * 2 * len(hierpredict.DENSITIES))
    assert hierpredict.LABEL in hierpredict.text_tables(res)
    back = json.loads(hierpredict.to_json(res))
    assert len(back["rows"]) == len(res["rows"]) and back["meta"]["kind"] == hierpredict.LABEL
    assert back["rows"][-1]["time_s"] == pytest.approx(res["rows"][-1]["time_s"], rel=1e-4)
    assert "| PREDICTION: NIC Gbit/s | nodes |" in hierpredict.markdown(res, nodes=None)


# --- the collective engine's prediction on NCCL (ombench.collcost, cost_model.py collective) ------------

# NCCL's tuning.cc constants, LL protocol, us: base Ring 6.6, Tree 6.8 (PAT, Simple: 8.0); per step NVLink
# 0.6 (ring and tree), NET Ring 2.7, Tree 5.0 (Tree Simple 14, PAT's); a network step's overhead 1.0.


def test_nccl_latencies_by_hand() -> None:
    from ombench import collcost as cc

    # the flat cluster: 8 GPUs, each a node (ppn = 1: every step a network step at the Tree's 5.0)
    assert cc.nccl_latencies_us("allreduce", 8, 8) == pytest.approx({"ring": 6.6 + 14 * 5.0,  # 2(W-1) steps: 76.6
                                                                     "tree": 6.8 + 2 * 3 * 5.0})  # 2 log2 8: 36.8
    assert cc.nccl_latencies_us("allgather", 8, 8) == pytest.approx({"ring": 6.6 + 7 * 5.0,  # W-1 steps: 41.6
                                                                     "pat": 8.0 + 3 * 14 / 3.5 + 2.8 * 8})  # 42.4
    assert cc.latency_s("allreduce", 8, cc.NET) == pytest.approx(36.8e-6)  # min(ring, tree)
    assert cc.latency_s("allgather", 8, cc.NET) == pytest.approx(41.6e-6)  # min(ring, PAT)
    assert cc.latency_s("alltoall", 8, cc.NET) == pytest.approx(41.6e-6)  # (assumed: a ring all-gather's)
    # 64 of them: the tree (6 levels) and PAT win
    assert cc.latency_s("allreduce", 64, cc.NET) == pytest.approx((6.8 + 2 * 6 * 5.0) * 1e-6)  # 66.8
    assert cc.latency_s("allgather", 64, cc.NET) == pytest.approx((8.0 + 6 * 4.0 + 2.8 * 64) * 1e-6)  # 211.2
    assert cc.latency_s("alltoall", 64, cc.NET) == pytest.approx((6.6 + 63 * 5.0) * 1e-6)  # 321.6
    # one node of 8 on NVLink: ring 6.6 + 14 x 0.6 = 15.0 against tree 6.8 + 2 x 7 x 0.6 = 15.2; no PAT
    assert cc.nccl_latencies_us("allreduce", 8, 1, "nvlink") == pytest.approx({"ring": 15.0, "tree": 15.2})
    assert cc.nccl_latencies_us("allgather", 8, 1, "nvlink") == pytest.approx({"ring": 6.6 + 7 * 0.6})
    assert cc.latency_s("allreduce", 8, cc.NVLINK) == pytest.approx(15.0e-6)
    # 8 nodes of 8 GPUs: 14 of the ring's 126 steps cross the network (at the Ring's 2.7), the other
    # 112 pay the posting overhead (1.0 > NVLink's 0.6); the tree: 7 NVLink steps and 3 levels, twice
    assert cc.nccl_latencies_us("allreduce", 64, 8) == pytest.approx({"ring": 6.6 + 112 * 1.0 + 14 * 2.7,
                                                                      "tree": 6.8 + 2 * (7 * 0.6 + 3 * 5.0)})
    assert cc.nccl_latencies_us("allgather", 64, 8) == pytest.approx({"ring": 6.6 + 56 * 1.0 + 7 * 2.7})
    assert cc.nccl_latencies_us("allreduce", 6, 6)["tree"] == pytest.approx(6.8 + 2 * 2 * 5.0)  # log2i(6) = 2
    assert cc.latency_s("allreduce", 1, cc.NET) == 0.0
    with pytest.raises(ValueError, match="alltoall"):
        cc.nccl_latencies_us("alltoall", 8, 8)


def test_ring_time_by_hand() -> None:
    from ombench import collcost as cc

    N = 100 << 20
    # 36.8 us of latency, then 2 x 7/8 x 104857600 bytes at 0.94 x 12.5e9 B/s = 15616.9 us
    assert cc.ring_time(N, 8, 100 * cc.GBIT, cc.NcclParams()) == pytest.approx(36.8e-6 + 183500800 / 11.75e9)
    assert cc.ring_time(N, 1, 100 * cc.GBIT, cc.NcclParams()) == 0.0


@pytest.mark.torch
def test_plan_bytes_by_hand_and_against_masks() -> None:
    from ombench import collcost as cc
    from ombench.traffic import collective_link_bytes

    # 1 MiB in blocks of 1 KiB: nb = 1024, a bitmap of 128 bytes; W = 4, every rank the same 64 blocks
    N, W, s, d = 1 << 20, 4, 1024, 64 / 1024

    def plan(name: str, density: float = d) -> tuple[list[str], list[float]]:
        colls = cc.plan_collectives(name, N, W, density, density, s)
        return [c for c, _ in colls], [b for _, b in colls]

    assert plan("gather") == (["allgather", "allgather"], pytest.approx([3 * 128, 3 * 64 * 1024]))
    assert plan("union") == (["allgather", "allreduce"], pytest.approx([384, 2 * 3 / 4 * 64 * 1024]))
    assert plan("owners") == (["allgather", "alltoall", "alltoall"], pytest.approx([384, 49152, 49152]))
    # fused: the bitmap (128 bytes, already 16-aligned) and a capacity of 64 + 16 + 1 = 81 blocks, up to
    # its size class (a multiple of 64 / 8): 88
    assert cc.fused_capacity(N, d, s) == 88
    assert plan("fused") == (["allgather"], pytest.approx([3 * (128 + 88 * 1024)]))
    assert plan("union", 0.0) == (["allgather"], pytest.approx([384]))  # nothing non-zero: the bitmaps only
    # the same blocks as masks (blocks 0-63: 16 per owner at lanes = 64, slots = 4), as the engine counts them
    masks = np.zeros((W, 1024), dtype=bool)
    masks[:, :64] = True
    for plan in ("gather", "union", "owners"):
        sent = collective_link_bytes(masks, 1 << 18, 256, 64, 4, exchange=plan)["r0 up"]
        assert sum(b for _, b in cc.plan_collectives(plan, N, W, d, d, s)) == pytest.approx(sent), plan


def test_plan_kernels_by_hand() -> None:
    from ombench import collcost as cc

    gpu = cc.GpuRates(flags=1e12, compact=2e12, scatter=4e12)
    N, W, s = 1 << 20, 4, 1024  # m = 64 blocks per rank, U = 128 in the union
    d, u = 64 / 1024, 128 / 1024
    m, U = 64 * 1024, 128 * 1024  # bytes
    union = cc.plan_kernels("union", N, W, d, u, s, gpu)
    assert union == pytest.approx({"flags": N / 1e12, "compact": (N + U) / 2e12, "sums": 0.0, "scatter": 2 * U / 4e12})
    gather = cc.plan_kernels("gather", N, W, d, u, s, gpu)
    assert gather["compact"] == pytest.approx((N + m) / 2e12)
    assert gather["sums"] == pytest.approx((4 * m + U) / 2e12)  # every rank's blocks read, the union written
    assert cc.plan_kernels("owners", N, W, d, u, s, gpu)["sums"] == pytest.approx((m + U / 4) / 2e12)
    assert cc.plan_kernels("fused", N, W, d, u, s, gpu)["compact"] == pytest.approx((N + 88 * 1024) / 2e12)


@pytest.mark.parametrize(("W", "mine", "union", "latency", "order", "expect", "steady"), [
    # (unfused: the bitmaps' all-gather left out; steady: every exchange but gather pays it besides)
    (8, 8, 64, 256 << 10, "any", "gather", "fused"),  # gather 56 blocks, union 112, owners 63 and two calls
    (8, 64, 64, 256 << 10, "any", "union", "union"),  # gather 448, union 112: 336 KiB saved > a call
    (8, 200, 800, 1024, "any", "owners", "owners"),  # gather 1400; union 1400; owners 7/8 x 1000 = 875
    (8, 64, 64, 1024, "rank", "owners", "owners"),  # union left out: gather 448 against owners 112
    (2, 10, 10, 1024, "any", "gather", "fused"),  # tie at 10 blocks: the first listed; no owners at W = 2
    (2, 10, 15, 1024, "any", "gather", "fused"),  # gather 10, union 15
    (4, 1, 1, 256 << 10, "any", "union", "fused"),  # the same block everywhere: union 2 (ceil 1.5) against
    # gather 3; steady: union a call more, 1 KiB saved < 256 KiB
])
def test_engine_plan_matches_plan_choose(W: int, mine: int, union: int, latency: int, order: str,
                                         expect: str, steady: str) -> None:
    """The cost model's plan is the engine's choice on the same counts, priced both ways: one
    reduction's exchange after the bitmaps, and the steady state where a shape that went gather is
    fused (``choose(fused=True)``, which the engine uses)."""
    from ombench import collcost as cc
    from omnireduce.engines.plan import Counts, Exchange, Order, choose

    nb, s = 1024, 1024
    pairs = tuple(tuple(mine // W for _ in range(W)) for _ in range(W)) if W > 2 else ()
    owned = tuple(union // W for _ in range(W)) if W > 2 else ()
    counts = Counts((mine,) * W, union, False, pairs, owned)
    engine = choose(counts, s, order=Order(order), latency_bytes=latency)
    model = cc.engine_plan(nb * s, W, mine / nb, union / nb, s, latency, order=order, fuse=False)
    assert engine is Exchange(expect) and model == expect
    fused = choose(counts, s, order=Order(order), latency_bytes=latency, num_blocks=nb, fused=True)
    assert fused is Exchange("gather" if steady == "fused" else steady)
    assert cc.engine_plan(nb * s, W, mine / nb, union / nb, s, latency, order=order) == steady


def test_crossover_by_bisection() -> None:
    from ombench import collcost as cc

    assert cc.crossover(lambda d: d - 0.3, 1e-4) == pytest.approx(0.3, rel=1e-4)
    assert cc.crossover(lambda d: 1.0, 1e-4) is None  # slower even at the smallest density: never
    assert cc.crossover(lambda d: -1.0, 1e-4) == 1.0  # faster even when dense: always
    # The model by hand: 100 MiB on W = 8 at 100 Gbit/s, f = 1, free kernels, 1000 us of host work, every
    # rank the same blocks (overlap: u = d), so the engine reduces the union with an all-reduce (its
    # choice: union 1.75 m blocks against gather 7 m). Both pay the all-reduce's latency; the engine adds
    # the host work, the bitmaps' all-gather (41.6 us, and 7 x 12800 bytes = 7.168 us at 12.5 GB/s) and
    # sends 1.75 d N against the ring's 1.75 N: they meet at
    #   d* = 1 - (1000 + 41.6 + 7.168) us x 12.5e9 B/s / (1.75 x 104857600 B) = 1 - 13109600 / 183500800
    free = cc.GpuRates(flags=1e30, compact=1e30, scatter=1e30)
    s = cc.Setting(100 << 20, 8, 100 * cc.GBIT, cc.NcclParams(fraction=1.0), free, host_s=1e-3)
    assert s.plan(0.5, "overlap") == "union"
    ring = s.ring()

    def gap(d: float) -> float:
        return s.engine(d, "overlap") - ring

    assert cc.crossover(gap, s.one_block()) == pytest.approx(1 - 13109600 / 183500800, rel=1e-4)  # 0.92856
    # a host costing more than the ring itself: never
    slow = cc.Setting(100 << 20, 8, 100 * cc.GBIT, cc.NcclParams(fraction=1.0), free, host_s=1.0)
    assert cc.crossover(lambda d: slow.engine(d, "random") - slow.ring(), slow.one_block()) is None


PROFILE = {  # what gpu_nccl_check.py profile writes (trimmed; numbers made up, of a plausible size)
    "measured": True, "gpu": "NVIDIA H100 80GB HBM3", "device": "cuda", "backend": "nccl", "world_size": 2,
    "transport": "emulated network: NCCL socket transport on loopback, not NVLink",
    "nccl_env": {"NCCL_VERSION": "2.28.3-1"}, "fixed_from": {"bytes": 1 << 20, "density": 0.01},
    "per_bucket_fixed_us": {"flags": 12.0, "bitmap all-gather": 900.0, "counts": 800.0, "sums": 60.0, "other": 90.0},
    "buckets": [
        {"bytes": 1 << 20, "density": 0.01, "phases": {
            "flags": {"host_us": 12.0, "device_us": 2.0}, "bitmap all-gather": {"host_us": 30.0, "device_us": 900.0},
            "counts": {"host_us": 800.0, "device_us": 1.0}, "sums": {"host_us": 60.0, "device_us": 20.0},
            "other": {"host_us": 90.0, "device_us": 5.0}}},
        {"bytes": 100 << 20, "density": 0.01, "phases": {
            "flags": {"host_us": 15.0, "device_us": 30.0}, "counts": {"host_us": 999.0, "device_us": 1.0}}}]}

ENGINE = {  # what bench_engine.py / gpu_nccl_check.py engine write (trimmed; made up)
    "backend": "nccl", "gpu": "NVIDIA H200", "unit_ms": {"1": 0.04, "2": 0.05},
    "rows": [
        {"world": 1, "elements": 65536, "density": 0.0, "exchange": "auto", "path": "device", "engine_ms": 0.3,
         "unit_ms": 0.04, "units": 7.5, "collectives_per_reduction": 1.0, "host_s_per_reduction": 2.0e-4},
        {"world": 2, "elements": 65536, "density": 0.0, "exchange": "auto", "path": "device", "engine_ms": 0.2,
         "unit_ms": 0.05, "units": 4.0, "collectives_per_reduction": 1.0, "host_s_per_reduction": 3.0e-4},
        {"world": 2, "elements": 1048576, "density": 0.0, "exchange": "auto", "path": "device", "engine_ms": 0.3,
         "unit_ms": 0.05, "units": 6.0, "collectives_per_reduction": 1.5, "host_s_per_reduction": 4.0e-4},
        # not taken: the host path, another exchange, a denser bucket
        {"world": 2, "elements": 65536, "density": 0.0, "exchange": "auto", "path": "host", "engine_ms": 9.0,
         "unit_ms": 0.05, "units": 180.0, "collectives_per_reduction": 1.0, "host_s_per_reduction": 9.0e-3},
        {"world": 2, "elements": 65536, "density": 0.0, "exchange": "owners", "path": "device", "engine_ms": 9.0,
         "unit_ms": 0.05, "units": 180.0, "collectives_per_reduction": 3.0, "host_s_per_reduction": 9.0e-3},
        {"world": 2, "elements": 65536, "density": 0.1, "exchange": "auto", "path": "device", "engine_ms": 9.0,
         "unit_ms": 0.05, "units": 180.0, "collectives_per_reduction": 2.0, "host_s_per_reduction": 9.0e-3}]}


def test_measured_host_work_from_both_formats(tmp_path: Path) -> None:
    from ombench import collcost as cc

    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    prof = cc.load_measured(tmp_path / "profile.json")
    # the 1 MiB bucket's phases less "counts" (the host waiting for the transport): 12 + 30 + 60 + 90
    assert prof.kind == "profile" and prof.host_us == pytest.approx(192.0)
    assert prof.detail["counts_host_us"] == 800.0 and prof.detail["per_bucket_fixed_us"] == PROFILE[
        "per_bucket_fixed_us"]
    assert "H100" in prof.source and "loopback" in prof.source and "2.28.3-1" in prof.source
    assert "profiler" in prof.caveat
    (tmp_path / "engine.json").write_text(json.dumps(ENGINE))
    eng = cc.load_measured(tmp_path / "engine.json", shown="x/engine.json")
    # the device path's one-block rows of the default exchange: median of 200, 300, 400 us
    assert eng.kind == "engine" and eng.host_us == pytest.approx(300.0) and eng.source.startswith("x/engine.json")
    by_world = eng.detail["one_block_by_world"]
    assert by_world[1]["units"] == 7.5 and by_world[2]["units"] == pytest.approx(5.0)  # median of 4 and 6
    assert by_world[2]["collectives_per_reduction"] == pytest.approx(1.25)
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="neither"):
        cc.load_measured(tmp_path / "other.json")


def test_cost_model_collective_subcommand(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    for name, doc in (("profile.json", PROFILE), ("engine.json", ENGINE)):
        (tmp_path / name).write_text(json.dumps(doc))
        out = subprocess.run([sys.executable, str(root / "scripts" / "cost_model.py"), "collective", "--out",
                              str(tmp_path / name[:-5]), "--densities", "0.1,0.01", "--measured", str(tmp_path / name)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        assert out and all(line.startswith("PREDICTION") for line in out.splitlines()), out
        res = json.loads((tmp_path / name[:-5] / "collective_measured.json").read_text())
        assert res["meta"]["prediction"] is True and res["meta"]["nccl"]["fraction"] == 0.94
        assert res["meta"]["measured"]["host_us"] == pytest.approx(192.0 if name == "profile.json" else 300.0)
        assert [h["host_us"] for h in res["meta"]["hosts"]][1:] == [300.0, 100.0]
        settings = {(c["rate_gbit"], c["workers"], c["placement"]) for c in res["crossovers"]}
        assert settings == {(r, w, p) for r in (100.0, 400.0) for w in (8, 64) for p in ("random", "overlap")}
        for c in res["crossovers"]:  # less host work: the engine pays off up to a higher density
            xs = [h["crossover"] for h in c["by_host"]]
            assert all(x is not None for x in xs) and xs[1] <= xs[2], c


def _graphs_row(world: int, elements: int, fused: int, unc: tuple[float, float], gra: tuple[float, float]) -> dict:
    """A row of what gpu_nccl_check.py graphs writes (trimmed): (engine thread us, of which waiting) a way."""
    def way(host: tuple[float, float]) -> dict:
        return {"host_us": host[0], "host_wait_us": host[1], "cpu_us": host[0], "fused": fused}

    return {"world": world, "elements": elements, "density": 0.01, "uncaptured": way(unc), "graphs": way(gra)}


GRAPHS = {"command": "graphs", "backend": "nccl", "gpu": "NVIDIA H200", "rows": [
    _graphs_row(1, 65536, 10, (500.0, 100.0), (150.0, 60.0)),  # 400 and 90 us of work
    _graphs_row(1, 1 << 20, 10, (700.0, 100.0), (170.0, 60.0)),  # 600 and 110
    _graphs_row(1, 1 << 22, 10, (900.0, 400.0), (200.0, 70.0)),  # 500 and 130
    _graphs_row(1, 1 << 16, 0, (9e9, 0.0), (9e9, 0.0)),  # taken whole: not read
    _graphs_row(2, 1 << 20, 10, (9e9, 0.0), (9e9, 0.0))]}  # another world: not read


def test_measured_host_time_at_one_rank(tmp_path: Path) -> None:
    """The W=1 host time per bucket: from a graphs run both ways (the engine thread's, less its wait for the
    counts, median over the fused buckets), from an engine run one world's one-block rows."""
    from ombench import collcost as cc

    (tmp_path / "graphs.json").write_text(json.dumps(GRAPHS))
    m = cc.load_measured(tmp_path / "graphs.json")
    assert m.kind == "graphs" and m.host_us == pytest.approx(500.0)  # median of 400, 600, 500
    assert m.detail["graphs_host_us"] == pytest.approx(110.0) and m.detail["rows"] == 3  # median of 90, 110, 130
    with pytest.raises(ValueError, match="no fused rows at W=4"):
        cc.load_measured(tmp_path / "graphs.json", world=4)
    (tmp_path / "engine.json").write_text(json.dumps(ENGINE))
    assert cc.load_measured(tmp_path / "engine.json", world=1).host_us == pytest.approx(200.0)
    assert cc.load_measured(tmp_path / "engine.json", world=2).host_us == pytest.approx(350.0)  # 300, 400


def test_host_time_table_per_bucket_and_host(tmp_path: Path) -> None:
    """cost_model.py host: a column per host time (measured both ways from a graphs run, then the
    targets), a row per bucket, link, GPUs and placement; each cell the crossover collcost finds for
    that host time; less host time never lowers it."""
    from ombench import collcost as cc
    from ombench import hostcost

    (tmp_path / "graphs.json").write_text(json.dumps(GRAPHS))
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "cost_model.py"), "host", "--out", str(tmp_path),
                          "--measured", str(tmp_path / "graphs.json")], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out and all(line.startswith("PREDICTION") for line in out.splitlines()), out
    res = json.loads((tmp_path / "collective_host.json").read_text())
    assert res["meta"]["prediction"] is True and res["meta"]["sizes_mib"] == [25.0, 100.0]
    assert [(h["host"], h["host_us"]) for h in res["meta"]["hosts"]] == [
        ("measured, uncaptured", 500.0), ("measured, CUDA graphs", 110.0), ("target, uncaptured", 300.0),
        ("target, CUDA graphs", 100.0)]
    assert {(r["size_mib"], r["rate_gbit"], r["workers"], r["placement"]) for r in res["rows"]} == {
        (s, r, w, p) for s in (25.0, 100.0) for r in (100.0, 400.0) for w in (8, 64) for p in ("random", "overlap")}
    for r in res["rows"]:
        by = {h["host"]: h["crossover"] or 0.0 for h in r["by_host"]}
        assert by["measured, uncaptured"] <= by["target, uncaptured"] <= by["measured, CUDA graphs"], r
    row = next(r for r in res["rows"] if (r["size_mib"], r["rate_gbit"], r["workers"], r["placement"]) == (
        25.0, 400.0, 8, "overlap"))
    s = cc.Setting(25 << 20, 8, 400 * cc.GBIT, host_s=100e-6)
    want = cc.crossover(lambda d: s.engine(d, "overlap") - s.ring(), s.one_block())
    assert row["by_host"][3]["crossover"] == pytest.approx(want) and row["ring_ms"] == pytest.approx(s.ring() * 1e3)
    lines = hostcost.markdown(res)
    assert lines[0].startswith("PREDICTION") and "buckets 25 and 100 MiB fp32" in "\n".join(lines)
    assert sum(line.startswith("| 25 MiB") or line.startswith("| 100 MiB") for line in lines) == 16
    given = subprocess.run([sys.executable, str(root / "scripts" / "cost_model.py"), "host", "--out",
                            str(tmp_path / "given"), "--host-us", "240", "--sizes-mib", "25"],
                           capture_output=True, text=True, timeout=120, check=True)
    res = json.loads((tmp_path / "given" / "collective_host.json").read_text())
    assert [h["host_us"] for h in res["meta"]["hosts"]] == [240.0, 300.0, 100.0] and len(res["rows"]) == 8
    assert "given on the command line" in given.stdout


def test_the_collective_prediction_takes_omnireduce_bench_measurements(tmp_path: Path) -> None:
    """An ``omnireduce-bench --json`` file gives the engine's host work per call (its lowest density's median
    ``engine_host_us``), and a measured latency unit replaces NCCL's published latency for every collective."""
    from ombench import collcost

    rows = [{"density": d, "engine_host_us": h, "unit_us": 40.0, "engine_ms": 1.0}
            for d, h in ((0.001, 300.0), (0.001, 500.0), (0.001, 400.0), (0.1, 9000.0))]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"header": {"backend": "nccl", "world_size": 8, "device": "GPU"}, "rows": rows}))
    measured = collcost.load_measured(path)
    assert measured.host_us == 400.0 and measured.detail["density"] == 0.001 and measured.detail["unit_us"] == 40.0
    mine = dataclasses.replace(collcost.NET, unit_us=40.0)
    assert collcost.latency_s("allreduce", 64, mine) == collcost.latency_s("alltoall", 8, mine) == pytest.approx(40e-6)
    assert collcost.latency_s("allreduce", 64, collcost.NET) != pytest.approx(40e-6)  # (the published model otherwise)
