"""The benchmarks' pure arithmetic: wire floors, link rates and tbf sizes, and the report tables.

No root, no processes, no torch: :mod:`ombench` imports none of them for these.
"""

from __future__ import annotations

import numpy as np
import pytest

from ombench import netem, tables
from ombench.collectives import wire_floor
from ombench.traffic import block_bytes, omnireduce_link_bytes, ring_bytes
from omnireduce.blocks import block_nonzero
from omnireduce.dtypes import DType

# 10 elements in blocks of 4: blocks of 16, 16 and 8 bytes (the last one short)
NUMEL, BLOCK = 10, 4
MASKS = np.array([[True, False, True], [False, True, True]])


def test_block_bytes_counts_the_short_last_block() -> None:
    assert block_bytes(NUMEL, BLOCK).tolist() == [16, 16, 8]
    assert block_bytes(8, BLOCK).tolist() == [16, 16]


def test_omnireduce_links_one_aggregator() -> None:
    # lanes 32768, slots 4: a 3-block tensor is one slot of 3 lanes, all on aggregator 0
    links = omnireduce_link_bytes(MASKS, NUMEL, BLOCK, 1, 32768, 4)
    assert links == {"w0 up": 24, "w0 down": 40, "w1 up": 24, "w1 down": 40, "a0 down": 48, "a0 up": 80}
    assert wire_floor("omnireduce", MASKS, NUMEL, BLOCK, 1, 32768, 4) == (80, "a0 up")


def test_omnireduce_links_two_aggregators() -> None:
    # 1 lane per slot: blocks 0, 1, 2 in slots 0, 1, 2 -> aggregators 0, 1, 0
    links = omnireduce_link_bytes(MASKS, NUMEL, BLOCK, 2, 1, 4)
    assert links["a0 down"] == 24 + 8  # w0's blocks 0 and 2, w1's block 2
    assert links["a0 up"] == 2 * (16 + 8)
    assert links["a1 down"] == 16 and links["a1 up"] == 2 * 16
    assert wire_floor("omnireduce", MASKS, NUMEL, BLOCK, 2, 1, 4) == (48, "a0 up")


def test_dense_and_allgather_floors() -> None:
    assert wire_floor("gloo", MASKS, NUMEL, BLOCK, 0, 0, 0)[0] == 40  # 2 (W-1)/W * 40 bytes
    assert wire_floor("mpi", MASKS, NUMEL, BLOCK, 0, 0, 0)[0] == 40
    assert wire_floor("agsparse", MASKS, NUMEL, BLOCK, 0, 0, 0)[0] == 1 * 2 * (4 * 4 + 8)
    assert wire_floor("gloo", MASKS[:1], NUMEL, BLOCK, 0, 0, 0)[0] == 0  # W=1: nothing to move
    with pytest.raises(ValueError):
        wire_floor("nccl", MASKS, NUMEL, BLOCK, 0, 0, 0)


def test_block_nonzero_matches_the_benchmarks_old_mask() -> None:
    """bench_allreduce used ``(padded != 0).any(1)``; omnireduce's block_nonzero gives the same masks."""
    rng = np.random.default_rng(0)
    for numel in (1, 7, 8, 9, 255, 256, 257, 1000):
        for block in (1, 4, 256):
            x = np.zeros(numel, dtype=np.float32)
            picks = rng.random(numel)
            x[picks < 0.1] = -0.0
            x[(picks >= 0.1) & (picks < 0.13)] = rng.standard_normal(int(((picks >= 0.1) & (picks < 0.13)).sum()))
            x[(picks >= 0.13) & (picks < 0.14)] = np.float32(1e-45)  # subnormal: non-zero
            nb = -(-numel // block)
            padded = np.zeros(nb * block, dtype=np.float32)
            padded[:numel] = x
            old = (padded.reshape(nb, block) != 0).any(axis=1)
            assert np.array_equal(block_nonzero(x, DType.FLOAT32, block), old), (numel, block)
    tail_neg_zero = np.array([0, 0, 0, 0, 1, 0, 0, 0, -0.0, -0.0], dtype=np.float32)
    assert block_nonzero(tail_neg_zero, DType.FLOAT32, 4).tolist() == [False, True, False]


@pytest.mark.parametrize(("text", "bps"), [("1gbit", 10**9), ("10gbit", 10**10), ("100mbit", 10**8),
                                           ("2.5Gbit", 2_500_000_000), ("none", None), ("0", None), (None, None),
                                           (0, None), (12345, 12345)])
def test_parse_rate(text: str | int | None, bps: int | None) -> None:
    assert netem.parse_rate(text) == bps


def test_parse_rate_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        netem.parse_rate("fast")


def test_tbf_params() -> None:
    assert netem.tbf_params(10**9) == (125_000, 625_000)  # 1 ms of tokens, + 4 ms of queue
    assert netem.tbf_params(10**10) == (1_250_000, 6_250_000)
    assert netem.tbf_params(10**8) == (64 * 1024, 64 * 1024 + 50_000)  # at least one 64 KiB GSO packet


def _row(label: str, density: float, median_s: float, floor_s: float | None, aggregators: int | None = None,
         ) -> dict:
    row = {"method": label.split()[0], "label": label, "density": density, "median_s": median_s,
           "worker_cpu_s_per_op": 0.010, "aggregator_cpu_s_per_op": 0.002, "floor_s": floor_s,
           "time_over_floor": median_s / floor_s if floor_s else None}
    if aggregators is not None:
        row["aggregators"] = aggregators
    return row


ROWS = [_row("omnireduce A=1", 0.1, 0.004, 0.002, 1), _row("omnireduce A=4", 0.1, 0.002, 0.001, 4),
        _row("gloo", 0.1, 0.008, 0.004),
        _row("omnireduce A=1", 0.0, 0.001, 0.0, 1), _row("omnireduce A=4", 0.0, 0.001, 0.0, 4),
        _row("gloo", 0.0, 0.008, 0.004)]
META = {"workers": 2, "net": "1gbit", "placement": "random", "size_mib": 1, "iters": 3, "warmup": 1}


def test_report_table_divides_by_the_most_aggregators_and_survives_a_zero_floor() -> None:
    assert tables.ratio_label(ROWS) == "omnireduce A=4"
    assert tables.cpu_ms(ROWS[0]) == pytest.approx(12.0)
    table = tables.allreduce_markdown({"meta": META, "rows": ROWS})
    lines = table.splitlines()
    assert lines[2].endswith("| Gloo / omnireduce A=4 |")
    assert "| 0.1 | 4.0 (2.00x) | 2.0 (2.00x) | 8.0 (2.00x) | 4.00x |" in lines
    assert "| 0 | 1.0 | 1.0 | 8.0 (2.00x) | 8.00x |" in lines  # floor 0: the time alone
    assert "| 0.1 | 12 | 12 | 12 |" in lines


def test_report_without_gloo_has_no_ratio_column() -> None:
    rows = [r for r in ROWS if r["method"] != "gloo"]
    assert tables.ratio_label(rows) is None
    assert "Gloo /" not in tables.allreduce_markdown({"meta": META, "rows": rows})


def test_bench_tables_with_zero_and_missing_floors() -> None:
    labels = ["omnireduce A=1", "omnireduce A=4", "gloo"]
    rows = [*ROWS, _row(labels[0], 0.5, 0.003, None, 1), _row(labels[1], 0.5, 0.003, None, 4),
            _row(labels[2], 0.5, 0.003, None)]
    out = tables.net_table(rows, labels, [0.5, 0.1, 0.0], "1gbit")
    assert out.count("        -      -") >= 4  # floor and x of the rows with no floor
    out = tables.loopback_table(rows, labels, [0.1, 0.0])
    assert "gloo/omnireduce A=4" in out and "4.00x" in out and "8.00x" in out


def test_ring_bytes() -> None:
    assert ring_bytes(40, 2) == 40 and ring_bytes(40, 4) == 60  # 2 (W-1)/W of the tensor
    assert ring_bytes(40, 1) == 0.0  # alone: nothing to send


def test_the_scaling_fit_recovers_a_line_and_never_goes_negative() -> None:
    from ombench.scaling import fit_line

    rng = np.random.default_rng(3)
    sizes = [0.0625, 1.0, 25.0, 100.0, 400.0]
    fixed, per_mib = float(rng.uniform(0.5, 5)), float(rng.uniform(0.1, 3))
    got = fit_line(sizes, [fixed + per_mib * s for s in sizes])
    assert got == pytest.approx((fixed, per_mib), rel=1e-9)
    # noisy points: within a few percent of the line they came from
    noisy = [(fixed + per_mib * s) * (1 + rng.uniform(-0.02, 0.02)) for s in sizes]
    f2, p2 = fit_line(sizes, noisy)
    assert abs(f2 - fixed) / fixed < 0.1 and abs(p2 - per_mib) / per_mib < 0.05
    # a cost that falls with size has no per-MiB term; one proportional to size no fixed term
    assert fit_line(sizes, [10.0, 9.0, 8.0, 7.0, 6.0])[1] == 0.0
    assert fit_line(sizes, [3.0 * s for s in sizes]) == pytest.approx((0.0, 3.0), abs=1e-9)


def test_thread_cpu_counts_this_threads_work_to_the_nanosecond() -> None:
    import threading
    import time

    from ombench.cpu import cpu_seconds, thread_cpu

    me = f":{threading.get_native_id()}"
    before, total0 = thread_cpu(), cpu_seconds()
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.05:  # 50 ms of this thread's CPU
        pass
    after, total1 = thread_cpu(), cpu_seconds()
    mine = next(k for k in after if k.endswith(me))
    assert 0.045e9 <= after[mine] - before[mine] < 1e9
    assert total1 - total0 >= 0.045
