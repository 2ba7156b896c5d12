"""Jobs in turns (:mod:`omnireduce.engines.turns`): one at a time, in the order handed over, on the thread of
their own or on a caller's that waits for the next one; the thread ends once closed and every job is done."""

from __future__ import annotations

import random
import threading
import time

import pytest

from omnireduce.engines.turns import Turns


@pytest.mark.parametrize("waited", [0.5, 0.97])
def test_jobs_run_in_order_one_at_a_time_on_either_thread(waited: float) -> None:
    """Jobs handed over from one thread, some run by a waiting caller (only the next one, when nothing
    runs), the rest by the thread: every job runs once, in the order handed over, never two at once.
    Mostly waited for, the thread dozes between runs of waiting callers and takes the strays."""
    ran: list[tuple[int, int]] = []
    running = threading.Lock()
    finished = {i: threading.Event() for i in range(300)}

    def run(job: int) -> None:
        assert running.acquire(blocking=False), "two jobs at once"
        ran.append((job, threading.get_ident()))
        running.release()
        finished[job].set()

    ended: list[int] = []
    turns: Turns[int] = Turns(run, "test-turns", at_end=lambda: ended.append(threading.get_ident()), doze_s=0.001)
    here = 0
    rng = random.Random()
    for i in range(300):
        turns.put(i)
        if rng.random() < 0.02:
            time.sleep(0.003)  # (a caller that waits late, or not at all)
        if rng.random() < waited:
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


def _settled(turns: Turns[str], ran: list[tuple[str, int]]) -> None:
    """Jobs handed over and waited for until enough in a row ran here
    (:data:`omnireduce.engines.turns.SETTLE`); the thread, woken for each, may take one first: then
    the run starts again."""
    for i in range(200):
        job = f"w{i}"  # (a job is known by its identity)
        turns.put(job)
        if not turns.run_waited(job):
            _finished(ran, job)
        if turns.dozing:
            return
    raise AssertionError("the thread never dozed")


def _finished(ran: list[tuple[str, int]], job: str) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for name, who in list(ran):
            if name == job:
                return who
        time.sleep(0.001)
    raise AssertionError(f"{job} did not run within 10 s")


def test_a_job_no_one_waits_for_runs_while_the_thread_dozes() -> None:
    """Once waiting callers ran their jobs, handing over no longer wakes the thread; a job nobody waits
    for is run by the thread all the same, after which handing over wakes it again."""
    ran: list[tuple[str, int]] = []
    turns: Turns[str] = Turns(lambda job: ran.append((job, threading.get_ident())), "test-turns", doze_s=0.005)
    _settled(turns, ran)
    turns.put("stray")
    assert _finished(ran, "stray") == turns.thread.ident
    assert not turns.dozing
    turns.put("next")  # (woken for it: the thread runs it)
    assert _finished(ran, "next") == turns.thread.ident
    turns.close()
    turns.thread.join(10)
    assert [job for job, _ in ran][-2:] == ["stray", "next"]


def test_quiet_callers_end_the_doze_and_close_runs_what_is_left() -> None:
    ran: list[tuple[str, int]] = []
    turns: Turns[str] = Turns(lambda job: ran.append((job, threading.get_ident())), "test-turns", doze_s=0.002)
    _settled(turns, ran)
    deadline = time.monotonic() + 10
    while turns.dozing and time.monotonic() < deadline:  # (a whole doze with no job begun)
        time.sleep(0.002)
    assert not turns.dozing
    _settled(turns, ran)
    turns.put("left")  # (dozing: handed over without waking the thread, then closed at once)
    turns.close()
    turns.thread.join(10)
    assert not turns.thread.is_alive() and ran[-1] == ("left", turns.thread.ident)
