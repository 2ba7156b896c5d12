"""Jobs in turns (:mod:`omnireduce.engines.turns`): one at a time, in the order handed over, on the thread of
their own or on a caller's that waits for the next one; the thread ends once closed and every job is done."""

from __future__ import annotations

import random
import threading

from omnireduce.engines.turns import Turns


def test_jobs_run_in_order_one_at_a_time_on_either_thread() -> None:
    """Jobs handed over from one thread, some run by a waiting caller (only the next one, when nothing
    runs), the rest by the thread: every job runs once, in the order handed over, never two at once."""
    ran: list[tuple[int, int]] = []
    running = threading.Lock()
    finished = {i: threading.Event() for i in range(300)}

    def run(job: int) -> None:
        assert running.acquire(blocking=False), "two jobs at once"
        ran.append((job, threading.get_ident()))
        running.release()
        finished[job].set()

    ended: list[int] = []
    turns: Turns[int] = Turns(run, "test-turns", at_end=lambda: ended.append(threading.get_ident()))
    here = 0
    rng = random.Random()
    for i in range(300):
        turns.put(i)
        if rng.random() < 0.5:
            here += turns.run_waited(i)
    for event in finished.values():
        assert event.wait(10)
    turns.close()
    turns.thread.join(10)
    assert not turns.thread.is_alive()
    assert [job for job, _ in ran] == list(range(300))
    assert here == sum(1 for _, who in ran if who == threading.get_ident())  # (True exactly when it ran here)
    assert ended == [turns.thread.ident]  # (at_end on the thread, once, last)


def test_a_caller_runs_only_the_next_job_and_only_when_nothing_runs() -> None:
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def run(job: str) -> None:
        if job == "slow":
            started.set()
            assert gate.wait(10)
        ran.append(job)

    turns: Turns[str] = Turns(run, "test-turns")
    turns.put("slow")
    assert started.wait(10)  # (the thread runs it)
    turns.put("a")
    turns.put("b")
    assert not turns.run_waited("a")  # something runs
    assert not turns.run_waited("slow")  # not waiting any more
    gate.set()
    turns.close()
    turns.thread.join(10)
    assert ran == ["slow", "a", "b"] and not turns.thread.is_alive()
    idle: Turns[str] = Turns(ran.append, "test-turns")
    idle.put("c")
    idle.put("d")
    assert not idle.run_waited("d")  # not the next
    idle.close()
    idle.thread.join(10)
    assert ran[-2:] == ["c", "d"]
