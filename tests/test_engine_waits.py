"""The engine's waits on the device: a deadline that fails with what it waited for, and none that
fails early. (A CUDA event's ``query`` is the only thing ``poll`` calls; here an object that
answers like one, since no GPU runs here: tests/test_cuda_path.py runs the real thing.)"""

from __future__ import annotations

import time

import pytest

from omnireduce.engines.waits import poll
from omnireduce.errors import OmniReduceError


class _Event:
    def __init__(self, done_after: float) -> None:
        self.at = time.monotonic() + done_after

    def query(self) -> bool:
        return time.monotonic() >= self.at


def test_poll_fails_at_the_deadline_naming_what_it_waited_for() -> None:
    t0 = time.monotonic()
    with pytest.raises(OmniReduceError, match=r"the bitmaps' all-gather did not finish within 0\.2 s"):
        poll(_Event(60.0), 0.2, "the bitmaps' all-gather")
    assert 0.2 <= time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_poll_returns_once_the_event_is_done(timeout: float | None) -> None:
    t0 = time.monotonic()
    poll(_Event(0.05), timeout, "x")
    assert 0.05 <= time.monotonic() - t0 < 5.0
