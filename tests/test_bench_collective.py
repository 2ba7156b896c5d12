"""The collective engine in the benchmarks: the bytes ``ombench.traffic.collective_link_bytes``
derives (bitmap all-gather + blocks to owners + sums back) against what the engine itself counts
in real ranks on a Gloo group, and the arithmetic on a case small enough to count by hand.

The rank side (:func:`engine_bytes`) runs in the test pool's processes, which do not have
``scripts/`` on their path: this module imports ``ombench`` inside the tests only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from omnireduce.launch.procs import free_port


def engine_bytes(rank: int, world_size: int, port: int, numel: int, block: int, lanes: int, slots: int,
                 densities: list[float], seed: int, exchange: str = "auto") -> list[dict[str, Any]]:
    """In rank ``rank``: one reduction per density of a float32 tensor with random non-zero blocks
    through a :class:`~omnireduce.engines.collective.CollectiveEngine`; the engine's info and its counters."""
    import torch
    import torch.distributed as dist

    from omnireduce.blocks import block_nonzero
    from omnireduce.dtypes import DType
    from omnireduce.engines.collective import CollectiveEngine
    from tests.collective_cases import process_group

    out = []
    with process_group(rank, world_size, port):
        engine = CollectiveEngine.for_group(dist.group.WORLD, 30.0, block, lanes, slots, exchange=exchange,
                                            fuse=False)  # (the formula: bitmaps in an all-gather of their own)
        try:
            for i, d in enumerate(densities):
                rng = np.random.default_rng(seed + 1000 * i + rank)
                x = rng.standard_normal(numel).astype(np.float32)
                nb = -(-numel // block)
                zero = rng.choice(nb, nb - round(nb * d), replace=False)
                for b in zero:
                    x[b * block:(b + 1) * block] = 0.0
                mask = block_nonzero(x, DType.FLOAT32, block)
                before = engine.stats()
                fut = engine.allreduce_async(torch.from_numpy(x))
                fut.wait()
                info = dataclasses.asdict(fut.info)  # (a ReductionInfo)
                after = engine.stats()
                out.append({"mask": mask.tolist(), "info": info, "exchanges": after["exchanges"],
                            "counted": {k: after[k] - before[k] for k in ("bytes_sent", "bytes_received")}})
        finally:
            engine.close()
    return out


def test_collective_link_bytes_by_hand() -> None:
    from ombench.collectives import wire_floor
    from ombench.traffic import collective_link_bytes

    # 10 elements in blocks of 4 (16 bytes each on the wire, the short one padded), 1 lane per slot, 3
    # slots, the owners' exchange: blocks 0, 1, 2 are
    # owned by ranks 0, 1, 0 (W = 2: slot s -> rank s mod 2); the bitmap is 1 byte
    masks = np.array([[True, False, True], [False, True, True]])
    links = collective_link_bytes(masks, 10, 4, 1, 3, exchange="owners")
    # rank 0 sends: bitmap 1 + none of its blocks (0 and 2 are its own) + its sums (blocks 0, 2) once
    assert links["r0 up"] == 1 + 0 + (16 + 16)
    # rank 0 receives: bitmap 1 + rank 1's block 2 + the sum of block 1 (rank 1's slot)
    assert links["r0 down"] == 1 + 16 + 16
    # rank 1 sends: bitmap + its block 2 (rank 0's) + the sum of block 1; receives bitmap + sums 0, 2
    assert links["r1 up"] == 1 + 16 + 16
    assert links["r1 down"] == 1 + (16 + 16)
    # fewer slots than ranks: the engine makes W of them (here 3 blocks in slots 0, 1, 0 of 2 slots)
    assert collective_link_bytes(masks, 10, 4, 1, 1, exchange="owners") == \
        collective_link_bytes(masks, 10, 4, 1, 2, exchange="owners")
    # gather: each rank's 2 blocks to the other; union: the ring moves 2 (W-1)/W of the union's 3
    assert set(collective_link_bytes(masks, 10, 4, 1, 3, exchange="gather").values()) == {1 + 2 * 16}
    assert set(collective_link_bytes(masks, 10, 4, 1, 3, exchange="union").values()) == {1 + 3 * 16}
    # the engine (auto): a bucket this small goes whole through the dense all-reduce (2 (W-1)/W of 40 bytes)
    assert wire_floor("collective", masks, 10, 4, 0, 1, 3) == (40, "r0 up")


def test_collective_rank_bytes_expectation() -> None:
    from ombench.traffic import collective_link_bytes, collective_rank_bytes, ring_bytes, union_density

    # dense: the ring's bytes plus the bitmaps
    N, W = 1 << 20, 4
    assert collective_rank_bytes(N, W, 1.0, 1.0) == ring_bytes(N, W) + 3 * 128
    assert union_density(0.1, 4, "overlap") == 0.1
    assert abs(union_density(0.5, 2) - 0.75) < 1e-12
    # against the exact count on random masks: within 2% at 65536 blocks in 4 slots of 16384 lanes
    rng = np.random.default_rng(3)
    numel, block = 65536 * 16, 16
    masks = rng.random((W, 65536)) < 0.1
    links = collective_link_bytes(masks, numel, block, 16384, 4, exchange="owners")
    u = masks.any(axis=0).mean()
    expect = collective_rank_bytes(numel * 4, W, masks.mean(), u, block_bytes=block * 4)
    for w in range(W):
        assert abs(links[f"r{w} up"] / expect - 1) < 0.02 and abs(links[f"r{w} down"] / expect - 1) < 0.02


def test_collective_link_bytes_are_the_engines_own(pool) -> None:
    """The formula against the engine's byte counters, rank by rank, at W = 3 with more lanes than
    ranks (lane l goes to rank l mod 3), a short last block and densities from empty to dense, for
    each exchange and the engine's own choice (bitmaps and blocks not fused: the formula's steps)."""

    W, numel, block, lanes, slots = 3, 40 * 64 - 17, 64, 10, 4
    densities = [0.0, 0.1, 0.5, 1.0]
    for exchange in ("owners", "gather", "union", "auto"):
        results = pool.call("tests.test_bench_collective:engine_bytes", W, port=free_port(), numel=numel,
                            block=block, lanes=lanes, slots=slots, densities=densities, seed=11, exchange=exchange)
        _check_bytes(results, W, numel, block, lanes, slots, densities, exchange)


def _check_bytes(results: list, W: int, numel: int, block: int, lanes: int, slots: int, densities: list[float],
                 exchange: str) -> None:
    from ombench.traffic import collective_link_bytes
    from omnireduce.engines.plan import goes_dense

    whole = exchange == "auto" and goes_dense(numel, 4, W)  # (this small a bucket: the dense all-reduce)
    assert whole == (exchange == "auto")
    for i, d in enumerate(densities):
        masks = np.array([results[r][i]["mask"] for r in range(W)], dtype=bool)
        links = collective_link_bytes(masks, numel, block, lanes, slots, exchange=exchange)
        for r in range(W):
            info, counted = results[r][i]["info"], results[r][i]["counted"]
            assert info["blocks_union"] == (masks.shape[1] if whole else int(masks.any(axis=0).sum()))
            assert counted["bytes_sent"] == info["bytes_sent"] == links[f"r{r} up"], (d, r, info, links)
            assert counted["bytes_received"] == info["bytes_received"] == links[f"r{r} down"], (d, r, info, links)


def test_report_table_has_gloo_over_the_collective_engine() -> None:
    from ombench import tables

    def row(label: str, median_s: float) -> dict:
        return {"method": label.split()[0], "label": label, "density": 0.1, "median_s": median_s,
                "worker_cpu_s_per_op": 0.01, "floor_s": None, "time_over_floor": None}

    meta = {"workers": 4, "net": "loopback", "placement": "random", "size_mib": 1, "iters": 3, "warmup": 1}
    rows = [row("collective", 0.002), row("omnireduce", 0.004) | {"aggregators": 1}, row("gloo", 0.010)]
    lines = tables.allreduce_markdown({"meta": meta, "rows": rows}).splitlines()
    assert lines[2] == "| density | collective ms | omnireduce ms | gloo ms | Gloo / omnireduce | Gloo / collective |"
    assert "| 0.1 | 2.0 | 4.0 | 10.0 | 2.50x | 5.00x |" in lines
    # without a collective row the table is as before
    assert "Gloo / collective" not in tables.allreduce_markdown({"meta": meta, "rows": rows[1:]})
