"""No code of ours runs on a process group's threads: omnireduce.engines.completer on its own, and the
dense all-reduce's reductions on a real Gloo group (their continuations ran on Gloo's thread until a
full run hung: DDP's reducer, collected with the GIL held, joined that thread while it waited for the GIL)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from omnireduce.engines.completer import Completer
from omnireduce.launch.procs import free_port
from tests.harness import RankPool


def _set_later(fut: torch.futures.Future, value: object, delay: float = 0.05) -> threading.Thread:
    """Complete ``fut`` from a thread of its own (as a backend would), after ``delay`` seconds."""

    def run() -> None:
        time.sleep(delay)
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)

    t = threading.Thread(target=run, name="backend")
    t.start()
    return t


def test_continuations_run_on_the_completers_thread_in_the_order_handed_over() -> None:
    completer = Completer("test-completer")
    seen: list[tuple[int, str, object]] = []
    done = threading.Event()
    futures = [torch.futures.Future() for _ in range(5)]
    for i, f in enumerate(futures):
        completer.submit(f, lambda f, i=i: (seen.append((i, threading.current_thread().name, f.value())),
                                            i == 4 and done.set()))
    setters = [_set_later(f, 10 * i, delay=0.01 * (5 - i)) for i, f in enumerate(futures)]  # the last first
    assert done.wait(10), f"the continuations did not all run: {seen}"
    for t in setters:
        t.join()
    assert seen == [(i, "test-completer", 10 * i) for i in range(5)]


def test_a_future_complete_already_is_continued_at_once_on_the_callers_thread() -> None:
    completer = Completer("test-completer")
    f: torch.futures.Future = torch.futures.Future()
    f.set_result(3)
    seen: list[tuple[str, object]] = []
    completer.submit(f, lambda f: seen.append((threading.current_thread().name, f.value())))
    assert seen == [(threading.current_thread().name, 3)]


def test_a_failure_reaches_the_continuation_and_a_raising_one_stops_nothing_after_it() -> None:
    completer = Completer("test-completer")
    failed, raising, last = (torch.futures.Future() for _ in range(3))
    seen: list[str] = []
    done = threading.Event()

    def read(f: torch.futures.Future) -> None:
        try:
            f.value()
        except ValueError as e:
            seen.append(f"failed: {e}")

    completer.submit(failed, read)
    completer.submit(raising, lambda f: (seen.append("raising"), 1 / 0))
    completer.submit(last, lambda f: (seen.append(f"last: {f.value()}"), done.set()))
    for f, v in ((failed, ValueError("peer gone")), (raising, 1), (last, 2)):
        _set_later(f, v, delay=0.0).join()
    assert done.wait(10), seen
    assert seen == ["failed: peer gone", "raising", "last: 2"]


def test_the_thread_ends_when_idle_and_a_later_future_starts_another() -> None:
    completer = Completer("test-completer-idle", idle=0.05)

    def threads() -> int:
        return sum(t.name == "test-completer-idle" for t in threading.enumerate())

    for _ in range(2):
        f: torch.futures.Future = torch.futures.Future()
        ran = threading.Event()
        completer.submit(f, lambda f, ran=ran: ran.set())
        assert threads() == 1
        _set_later(f, 0).join()
        assert ran.wait(10)
        deadline = time.monotonic() + 10
        while threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads() == 0, "the completer's thread outlived its idle time"


def test_close_runs_what_was_handed_over_then_ends_the_thread_and_keeps_nothing() -> None:
    import gc
    import weakref

    completer = Completer("test-completer-close", idle=60)

    class Payload:  # (what a continuation holds: a bucket's tensor, say)
        pass

    payload = Payload()
    held = weakref.ref(payload)
    seen: list[int] = []
    f: torch.futures.Future = torch.futures.Future()
    completer.submit(f, lambda f, p=payload: seen.append(f.value()))
    del payload
    setter = _set_later(f, 7, delay=0.1)
    completer.close()
    setter.join()
    assert seen == [7], "close() returned before the continuation handed over ran"
    assert not [t for t in threading.enumerate() if t.name == "test-completer-close"], "close() left the thread"
    gc.collect()
    assert held() is None, "the completer kept a continuation's objects after running it"
    g: torch.futures.Future = torch.futures.Future()  # (a later future starts the thread again)
    ran = threading.Event()
    completer.submit(g, lambda g: ran.set())
    _set_later(g, 0, delay=0.0).join()
    assert ran.wait(10)
    completer.close()


def dense_on_gloo(rank: int, world_size: int, port: int, sizes: list[int]) -> dict:
    """The dense all-reduce's reductions on a real Gloo group: the thread each completed on, whether it
    was one Python made (Gloo's own threads show as threading's dummies) and the sums' bytes."""
    from omnireduce.engines.dense import DenseReducer
    from tests.ddp_cases import process_group

    with process_group(rank, world_size, port):
        reducer = DenseReducer(None)
        g = torch.Generator().manual_seed(rank + 1)
        inputs = [torch.randn(n, generator=g) for n in sizes]
        threads: list[tuple[str, bool]] = []
        futures = []
        for x in inputs:
            fut = reducer.allreduce_async(x.clone(), average=False)
            fut.add_done_callback(lambda f: threads.append(
                (threading.current_thread().name, isinstance(threading.current_thread(), threading._DummyThread))))
            futures.append(fut)
        sums = [f.wait().numpy().tobytes() for f in futures]
        deadline = time.monotonic() + 10
        while len(threads) < len(futures) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"threads": threads, "sums": sums, "inputs": [x.numpy().tobytes() for x in inputs]}


def test_the_dense_all_reduce_completes_its_reductions_on_no_thread_of_gloos(pool: RankPool) -> None:
    sizes = [1, 1000, 65_537, 0]
    results = pool.call("tests.test_completer:dense_on_gloo", 2, port=free_port(), sizes=sizes)
    for rank, r in enumerate(results):
        assert len(r["threads"]) == len(sizes), f"rank {rank}: {r['threads']}"
        foreign = [name for name, dummy in r["threads"] if dummy]
        assert not foreign, f"rank {rank}: reductions completed on the backend's threads {foreign}"
    for i, n in enumerate(sizes):
        ref = sum(np.frombuffer(r["inputs"][i], dtype=np.float32).astype(np.float64) for r in results)
        for r in results:
            got = np.frombuffer(r["sums"][i], dtype=np.float32)
            assert got.shape == (n,)
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
