"""The collective engine's host buffers lent for each spell of reductions
(:mod:`omnireduce.engines.workspace`), and the sums they carry.

A host buffer of ``LEND_MIN`` bytes or more, where freed heap memory stays resident
(``heap_keeps``, forced here), is held for a spell only: mapped apart when nothing was lent (the size
asked now, the size the next reductions will ask remembered), let go at the spell's end, and lent
next time by the caller's thread with those sizes. Smaller buffers, and every buffer where the heap
would not keep freed memory, stay from one reduction to the next as before. The engine end to end
(real rank processes, Gloo, an aggregator): several spells of large buckets give the aggregators'
bits and the float64 reference's values, the later spells through lent buffers, and nothing lendable
is held between spells.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

import omnireduce
from omnireduce.engines import workspace as workspace_module
from omnireduce.engines.workspace import LEND_MIN, Workspace, mapped
from omnireduce.launch.procs import free_port
from tests.harness import Case, RankPool, assert_matches

CPU = torch.device("cpu")
MIB = 1 << 20


@pytest.fixture
def heap_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Freed heap memory stays resident below 32 MiB (as with the malloc tuning in effect)."""
    monkeypatch.setattr(workspace_module, "heap_keeps", lambda nbytes: nbytes < 32 * MIB)


_MAPPED: list[tuple[int, int]] = []  # (address, bytes) of every buffer mapped apart since the fixture


@pytest.fixture(autouse=True)
def watch_mappings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Record what :func:`mapped` makes for the workspace."""
    _MAPPED.clear()

    def spy(nbytes: int) -> torch.Tensor:
        t = mapped(nbytes)
        _MAPPED.append((t.data_ptr(), nbytes))
        return t

    monkeypatch.setattr(workspace_module, "mapped", spy)


def _base_is_mapping(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a buffer the workspace mapped apart (:func:`mapped`)."""
    p = t.data_ptr()
    return any(a <= p < a + n for a, n in _MAPPED)


def test_a_mapped_buffer_is_writable_and_apart_from_the_heap() -> None:
    t = mapped(3 * 65536)
    t[:] = 7
    assert t.dtype == torch.uint8 and t.numel() == 3 * 65536 and int(t.sum()) == 7 * 3 * 65536
    p = t.data_ptr()
    with open("/proc/self/maps") as f:  # the mapping that holds it: anonymous (no path, not [heap])
        spans = [line.split() for line in f]
    (span,) = [s for s in spans if int(s[0].split("-")[0], 16) <= p < int(s[0].split("-")[1], 16)]
    hi = int(span[0].split("-")[1], 16)
    assert len(span) == 5 and p + 3 * 65536 <= hi, span
    assert p % mmap.PAGESIZE == 0, "a mapping's start (a heap's chunk is not page-aligned)"


def test_a_spell_maps_what_was_not_lent_and_remembers_the_reserve(heap_keeps: None) -> None:
    ws = Workspace(lending=True)
    n = 2 * MIB + 12_345  # asked now; the reductions that follow will ask ``reserve``
    view = ws.take("gathered", (n,), torch.uint8, CPU, slack=True, reserve=4 * MIB)
    assert view.numel() == n and _base_is_mapping(view)
    assert ws.nbytes < n + 65536, "mapped with the size asked now (not the reserve, not a quarter more)"
    small = ws.take("bitmaps", (1000,), torch.uint8, CPU)  # under LEND_MIN: kept from spell to spell
    spent = ws.end_spell()
    assert len(spent) == 1 and spent[0].numel() >= n
    assert ws.demand() == {("gathered", CPU): 4 * MIB}
    assert ws.nbytes == small.untyped_storage().nbytes() > 0  # (only the small one is held)
    assert ws.take("bitmaps", (1000,), torch.uint8, CPU).data_ptr() == small.data_ptr()


def test_a_lent_buffer_is_used_and_let_go_at_the_spell_end(heap_keeps: None) -> None:
    ws = Workspace(lending=True)
    ws.take("send", (3 * MIB,), torch.uint8, CPU)
    ws.end_spell()
    (key, size), = ws.demand().items()
    lent = torch.empty(size, dtype=torch.uint8)
    ws.lend({key: lent})
    got = ws.take("send", (MIB, 3), torch.uint8, CPU)  # (any shape that fits)
    assert got.data_ptr() == lent.data_ptr() and got.shape == (MIB, 3)
    floats = ws.take("send", (1000, 256), torch.float32, CPU)
    assert floats.data_ptr() == lent.data_ptr()
    spent = ws.end_spell()
    assert len(spent) == 1 and spent[0] is lent
    assert ws.nbytes == 0 and ws.demand() == {key: size}


def test_a_lent_buffer_smaller_than_what_the_spell_holds_is_let_go(heap_keeps: None) -> None:
    ws = Workspace(lending=True)
    held = ws.take("send", (5 * MIB,), torch.uint8, CPU)
    ws.lend({("send", CPU): torch.empty(2 * MIB, dtype=torch.uint8)})
    assert ws.take("send", (5 * MIB,), torch.uint8, CPU).data_ptr() == held.data_ptr()
    bigger = ws.take("send", (6 * MIB,), torch.uint8, CPU)  # grows: mapped again, the demand with it
    assert bigger.data_ptr() != held.data_ptr() and _base_is_mapping(bigger)
    ws.end_spell()
    assert ws.demand()[("send", CPU)] >= 6 * MIB


@pytest.mark.parametrize("setting", ["off", "heap-would-not-keep", "small"])
def test_buffers_stay_from_spell_to_spell_where_nothing_is_lent(monkeypatch: pytest.MonkeyPatch,
                                                                setting: str) -> None:
    """Lending off, a heap that would not keep the memory (no malloc tuning, or a size past its mmap
    threshold), or a buffer under LEND_MIN: the buffer stays, with the quarter more it always took."""
    monkeypatch.setattr(workspace_module, "heap_keeps",
                        lambda nbytes: setting != "heap-would-not-keep" and nbytes < 32 * MIB)
    ws = Workspace(lending=setting != "off")
    n = LEND_MIN // 2 if setting == "small" else 3 * MIB
    first = ws.take("recv", (n,), torch.uint8, CPU)
    assert not _base_is_mapping(first)
    assert ws.end_spell() == [] and ws.demand() == {}
    again = ws.take("recv", (n + n // 8,), torch.uint8, CPU)  # (within the quarter more)
    assert again.data_ptr() == first.data_ptr()


# -- the engine, end to end ------------------------------------------------------------------------

def lent_spells(rank: int, world_size: int, port: int, aggregator: str, job: str, cases: list[Case],
                average: bool, repeat: int) -> list[dict]:
    """(Run in the ranks.) A worker (which tunes the allocator, as the DDP hook's does), then each case
    through the aggregators once and through the collective engine ``repeat`` times, each reduction a
    spell of its own; what was lent and what the workspace held after each spell."""
    import dataclasses

    import torch.distributed as dist

    from omnireduce._malloc import heap_keeps as keeps
    from omnireduce.engines.collective import CollectiveEngine
    from tests.ddp_cases import process_group
    from tests.harness import make_input, to_bits, to_numpy

    out: list[dict] = []
    with process_group(rank, world_size, port), \
            omnireduce.Worker([aggregator], rank=rank, world_size=world_size, job=job, timeout=60) as w:
        engine = CollectiveEngine.for_group(dist.group.WORLD, 60.0, w.config.block_size, w.config.lanes, 4,
                                            order="rank")
        ws = engine._workspace
        lent: list[int] = []
        real = ws.lend

        def spy(buffers: dict) -> None:
            lent.append(sum(b.numel() for b in buffers.values()))
            real(buffers)

        ws.lend = spy  # type: ignore[method-assign]
        try:
            for case in cases:
                a = make_input(case, rank)
                w.allreduce(a, average=average)
                for _ in range(repeat):
                    before = len(lent)
                    b = make_input(case, rank)
                    b = b if isinstance(b, torch.Tensor) else torch.from_numpy(b)
                    fut = engine.allreduce_async(b, average=average)
                    fut.wait()  # (completed once the spell has ended: its buffers let go)
                    held = sum(t.numel() for t in ws._bufs.values() if t is not None and t.numel() >= LEND_MIN)
                    out.append({"aggregators": to_bits(a), "collective": to_bits(b), "values": to_numpy(b),
                                "lent": lent[before:], "held": held, "demand": sum(ws.demand().values()),
                                "info": dataclasses.asdict(fut.info)})
            out.append({"stats": engine.stats(), "tuned": keeps(LEND_MIN)})
        finally:
            engine.close()
    return out


@pytest.mark.parametrize("average", [False, True])
def test_the_engine_lends_its_host_buffers_and_gives_the_aggregators_bits(pool: RankPool, aggregator, job: str,
                                                                          average: bool) -> None:
    world_size, repeat = 2, 3
    cases = [Case(1 << 21, density=0.2, seed=41, specials=True), Case(3 << 20, density=0.1, seed=42, kind="torch"),
             Case(1 << 21, density=0.3, seed=43, placement="overlap")]
    results = pool.call("tests.test_workspace_lending:lent_spells", world_size, port=free_port(),
                        aggregator=aggregator.address, job=job, cases=cases, average=average, repeat=repeat,
                        timeout=300)
    for rank, per_rank in enumerate(results):
        assert per_rank[-1]["tuned"], "the worker tunes the allocator: freed heap memory stays"
        assert per_rank[-1]["stats"]["reductions"] == len(cases) * repeat
        for i, case in enumerate(cases):
            runs = per_rank[repeat * i: repeat * (i + 1)]
            for j, r in enumerate(runs):
                assert r["collective"] == r["aggregators"], f"rank {rank} {case} #{j}: the engines' bits differ"
                assert_matches(case, world_size, r["values"], average=average)
                assert r["held"] == 0, f"rank {rank} {case} #{j}: a lendable buffer is held between spells ({r})"
                assert r["demand"] >= LEND_MIN, r
            # the first spell of all had nothing to lend; every later one is lent what the last ones held
            assert all(r["lent"] for r in runs[1:]), f"rank {rank} {case}: later spells were not lent ({runs})"
        assert not per_rank[0]["lent"], per_rank[0]
        assert np.all([r["info"]["blocks_union"] > 0 for r in per_rank[:-1]])
