"""CUDA graphs of the collective engine's steady state (:mod:`omnireduce.engines.graphs`), as far as a
machine without a GPU can check them.

Pure: which reductions may be captured (:func:`~omnireduce.engines.graph_book.refusal`), the book
of graphs (a key's first reduction uncaptured, its second captured, then replays; least recently
used let go first; nothing after a failure), the switch. The guarded sum's host build: nothing
written where a count passes the capacity, the plain sum's bytes otherwise. Then the engine on real
Gloo groups with graphs made by a CPU stand-in (tests/graph_double.py: the same steps, the same
collectives, a replay's results found only in the graph's buffers) against the engine without:
the same bytes at every reduction through the steady state, an overflow of the capacity (finished
uncaptured) and back; the same collectives, bytes and counts; ranks with and without graphs in one
group; a failed capture; a bucket that moves; the graphs freed at the end. The GPU check runs the
real thing (``gpu_nccl_check.py graphs``).
"""

from __future__ import annotations

import pytest
import torch

from omnireduce.engines.graph_book import Action, GraphBook, GraphKey, overflowed, refusal
from omnireduce.launch.procs import free_port
from tests.engine_cases import SYNCING
from tests.exchange_host import needs_cxx
from tests.harness import RankPool

_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


class _Kernels:
    def sum_blocks_within(self) -> None: ...


class _Old:
    def sum_blocks(self) -> None: ...


_OK = dict(device_type="cuda", graph_device="cuda", threshold=0.0, kernels=_Kernels(), fused=True, world=4,
           max_world=100, host_waits=False, broken=None)


@pytest.mark.parametrize(("change", "words"), [
    ({}, None),
    ({"device_type": "cpu"}, "not a cuda tensor (cpu)"),
    ({"threshold": 0.01}, "a lossy threshold"),
    ({"kernels": None}, "the torch ops' way"),
    ({"kernels": _Old()}, "kernels without the guarded sum"),
    ({"fused": False}, "not fused: the bitmaps go first"),
    ({"world": 101}, "a group of 101 ranks"),
    ({"host_waits": True}, "the process group waits on the host"),
    ({"broken": "RuntimeError: boom"}, "a capture failed earlier: RuntimeError: boom"),
])
def test_what_a_graph_may_carry(change: dict, words: str | None) -> None:
    why = refusal(**{**_OK, **change})
    assert (why is None) if words is None else (why is not None and why.startswith(words)), why


def _key(address: int = 4096, capacity: int = 8, **change: object) -> GraphKey:
    fields = dict(device="cuda:0", address=address, numel=1 << 20, dtype="torch.float32", block_size=256,
                  capacity=capacity, world=2, total_lanes=1024, pairs=False, average=True)
    return GraphKey(**{**fields, **change})  # type: ignore[arg-type]


def test_a_key_runs_once_then_is_captured_then_replays() -> None:
    book: GraphBook[str] = GraphBook(limit=4)
    a = _key()
    assert book.plan(a) is Action.RUN  # the first: uncaptured (the communicator and kernels proven)
    assert book.plan(a) is Action.CAPTURE
    assert book.make_room() == []
    book.captured(a, "graph a")
    book.replayed(overflow=False)
    assert book.plan(a) is Action.REPLAY and book.graph(a) == "graph a"
    book.replayed(overflow=True)
    for other in (_key(capacity=16), _key(address=8192), _key(average=False), _key(pairs=True), _key(world=3)):
        assert book.plan(other) is Action.RUN, other  # a capacity, a buffer, a scale, ...: each its own graph
    assert book.counts == {"graph_captures": 1, "graph_replays": 2, "graph_fallbacks": 1, "graph_failures": 0}
    assert len(book) == 1


def test_the_book_keeps_the_most_recently_used_graphs() -> None:
    book: GraphBook[str] = GraphBook(limit=2)
    keys = [_key(address=4096 * (i + 1)) for i in range(3)]
    for k in keys[:2]:
        book.plan(k), book.plan(k)
        assert book.make_room() == []
        book.captured(k, f"g{k.address}")
    assert book.plan(keys[0]) is Action.REPLAY  # (the first, used again: the second is now the oldest)
    book.plan(keys[2])
    assert book.plan(keys[2]) is Action.CAPTURE
    assert book.make_room() == [f"g{keys[1].address}"]  # freed before the third is captured
    book.captured(keys[2], "g3")
    assert len(book) == 2 and book.plan(keys[1]) is Action.CAPTURE  # (seen before: captured again next)
    assert sorted(book.close()) == sorted([f"g{keys[0].address}", "g3"]) and len(book) == 0
    seen: GraphBook[str] = GraphBook(limit=1)
    for i in range(10):
        seen.plan(_key(address=i))
    assert seen.plan(_key(address=0)) is Action.RUN  # (keys remembered as seen: 4 x limit)
    with pytest.raises(ValueError):
        GraphBook(limit=0)


def test_after_a_failed_capture_nothing_is_captured() -> None:
    book: GraphBook[str] = GraphBook()
    a, b = _key(), _key(address=1)
    book.plan(a), book.plan(a)
    book.captured(a, "ga")
    book.plan(b), book.plan(b)
    assert book.fail("RuntimeError: capture invalidated") == ["ga"]  # every graph freed
    assert book.plan(a) is Action.RUN and book.plan(b) is Action.RUN and len(book) == 0
    assert book.broken == "RuntimeError: capture invalidated" and book.counts["graph_failures"] == 1


def test_overflow_is_any_rank_past_the_capacity() -> None:
    assert not overflowed((3, 8), 8) and overflowed((3, 9), 8) and overflowed((9,), 8) and not overflowed((), 0)


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnireduce.engines import graphs

    monkeypatch.delenv("OMNIREDUCE_CUDA_GRAPHS", raising=False)
    assert not graphs.enabled()
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("OMNIREDUCE_CUDA_GRAPHS", value)
        assert graphs.enabled() is on
    monkeypatch.setenv("OMNIREDUCE_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="OMNIREDUCE_CUDA_GRAPHS must be 0 or 1"):
        graphs.enabled()
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.delenv("NCCL_BLOCKING_WAIT", raising=False)
    assert not graphs.host_waits()
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    assert graphs.host_waits()
    assert graphs.counters(None) == {"graph_captures": 0, "graph_replays": 0, "graph_fallbacks": 0,
                                     "graph_failures": 0, "graphs": 0}


@needs_cxx
def test_the_guarded_sum_writes_nothing_past_the_capacity() -> None:
    """The host build of the guard the CUDA sum kernel checks: each of the sources' counts at most the
    limit: the plain sum's bytes; one count past it: the tensor untouched."""
    from tests.exchange_host import HostKernels

    k = HostKernels()
    W, B, n = 2, 256, 256 * 40 + 17
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.05)).contiguous() for _ in range(W)]
    nb, cap = -(-n // B), 41
    head = 16 * -(-nb // 128)  # (the bitmap's bytes, 16-aligned)
    gathered = torch.zeros(W, head + cap * B * 4, dtype=torch.uint8)
    for r in range(W):
        k.record(xs[r], B, 0.0, gathered[r], head, cap)
    bits, prefix, counts = k.counts(gathered, nb, 1024, False)
    first = gathered[:, head:].view(torch.float32).view(W, cap, B)
    plain = xs[0].clone()
    k.sum_blocks(plain, B, bits, prefix, W, 0, W, first, None, 0.5)
    assert not torch.equal(plain, xs[0])
    most = int(counts[:W].max())
    for limit, writes in ((most, True), (cap, True), (most - 1, False), (0, False)):
        got = xs[0].clone()
        k.sum_blocks_within(got, B, bits, prefix, W, 0, W, first, None, 0.5, counts, limit)
        assert torch.equal(got, plain if writes else xs[0]), (limit, most)


_CASES = [  # (large enough that no bucket takes the dense all-reduce whole at 2 or 3 ranks)
    {"numel": 70_001, "density": 0.02, "over": 0.3, "dtype": "float32", "seed": 11},
    {"numel": 140_001, "density": 0.02, "over": 0.3, "dtype": "bfloat16", "seed": 12, "average": True},
    {"numel": 140_001, "density": 0.05, "over": 0.6, "dtype": "float16", "seed": 13, "ugly": True},
    {"numel": 70_003, "density": 0.0, "over": 0.5, "dtype": "float32", "seed": 14},  # nothing, then half
]


def _check_same(results: list[dict], world: int, cases: list[dict]) -> None:
    """Every reduction's bytes, collectives, bytes sent, waits and overflows equal with and without
    graphs; the sums the float64 reference's."""
    for rank, res in enumerate(results):
        for case, steps in zip(cases, res["cases"], strict=True):
            for i, s in enumerate(steps):
                where = f"W={world} rank {rank} {case} reduction {i}"
                on, off = s["on"], s["off"]
                assert on["digest"] == off["digest"], f"{where}: the bits differ with graphs"
                for k in ("collectives", "bytes_sent", "host_waits", "fused", "overflows", "kernel_reductions"):
                    assert on[k] == off[k], (where, k, on[k], off[k])
                assert on["info"] == off["info"], where
                assert s["err"] <= _TOL[case["dtype"]] * max(s["scale"], 1e-30) + 1e-30, (where, s["err"])
                assert off["graph_replays"] == off["graph_captures"] == 0, where


@needs_cxx
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_graphs_give_the_uncaptured_bits_through_an_overflow(pool: RankPool, world_size: int) -> None:
    results = pool.call("tests.graph_cases:with_and_without", world_size, port=free_port(), cases=_CASES,
                        graphs_on=list(range(world_size)))
    _check_same(results, world_size, _CASES)
    for res in results:
        sparse = [steps for case, steps in zip(_CASES, res["cases"], strict=True) if case["density"] > 0]
        for steps in sparse:
            # the steady state: bitmaps first, then fused and uncaptured (warm), captured, replayed
            assert [s["on"]["graph_captures"] for s in steps[:4]] == [0, 0, 1, 0], steps
            assert [s["on"]["graph_replays"] for s in steps[:4]] == [0, 0, 1, 1], steps
            over = steps[4]["on"]
            assert over["overflows"] == over["graph_fallbacks"] == over["graph_replays"] == 1, over
            assert over["collectives"] == (2 if world_size > 1 else 0), over  # (the rest: a second all-gather)
        st = res["stats"]["on"]
        assert st["graph_replays"] >= 2 * len(sparse) and st["graph_fallbacks"] == len(_CASES), st  # (one a case)
        assert st["graph_failures"] == 0 and 0 < st["graphs"] == len(res["graphs"]) <= 16, st
        assert all(g["released"] for g in res["graphs"]), res["graphs"]  # (freed at the engine's end)
        assert res["stats"]["off"]["graph_captures"] == 0 and res["logs"] == [], res["logs"]
        nothing = res["cases"][3]  # (no block anywhere: captured and replayed, the sums write nothing)
        assert sum(s["on"]["graph_replays"] for s in nothing[:4]) == 2, nothing
        # what a graph holds reads nothing on the host: no op whose CUDA kernel makes the host wait
        assert len(res["watched"]) == st["graph_replays"], (len(res["watched"]), st)
        for w in res["watched"]:
            assert not set(w["ops"]) & set(SYNCING) and w["bool_indexed"] == [], w


@needs_cxx
def test_ranks_with_and_without_graphs_meet_at_every_collective(pool: RankPool) -> None:
    """Rank 0 replays graphs, rank 1 runs every reduction uncaptured, in one group: the same
    collectives at the same points, so the same bits as two uncaptured ranks."""
    results = pool.call("tests.graph_cases:with_and_without", 2, port=free_port(), cases=_CASES[:2],
                        graphs_on=[0])
    _check_same(results, 2, _CASES[:2])
    assert results[0]["stats"]["on"]["graph_replays"] > 0 and results[1]["stats"]["on"]["graph_replays"] == 0


@needs_cxx
def test_a_failed_capture_leaves_every_reduction_uncaptured(pool: RankPool) -> None:
    results = pool.call("tests.graph_cases:with_and_without", 2, port=free_port(), cases=_CASES[:1],
                        graphs_on=[0, 1], fail="capture invalidated (test)")
    _check_same(results, 2, _CASES[:1])
    for res in results:
        st = res["stats"]["on"]
        assert st["graph_failures"] == 1 and st["graph_replays"] == st["graph_captures"] == 0, st
        assert len(res["logs"]) == 1 and "capture invalidated (test)" in res["logs"][0], res["logs"]


@needs_cxx
def test_a_bucket_that_moves_and_a_small_book(pool: RankPool) -> None:
    """The graphed buffer moves in the steady state: its graph stays with the old memory, the new
    address is a new key (uncaptured once, then captured); with room for one graph only, each
    capture lets the last one go."""
    cases = [dict(_CASES[0], steady=5), dict(_CASES[1], steady=5)]
    results = pool.call("tests.graph_cases:with_and_without", 2, port=free_port(), cases=cases, graphs_on=[0, 1],
                        limit=1, moved=True)
    _check_same(results, 2, cases)
    for res in results:
        steps = res["cases"][0]
        assert [s["on"]["graph_captures"] for s in steps[:5]] == [0, 0, 0, 1, 0], steps  # (moved at 2)
        graphs = res["graphs"]
        assert len(graphs) >= 2 and all(g["released"] for g in graphs), graphs
