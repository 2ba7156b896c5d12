"""What omnireduce does at interpreter exit: three stages, in order, from one handler.

A training script that never closes its state still ends cleanly, because the parts it made are
closed at exit in this order, whatever order they were made in:

1. :data:`RELEASE`: what holds a process group's collective is let go while the interpreter still
   runs (the agreement's all-reduce in flight, the collective engines' threads and groups): a Gloo
   work destroyed during the interpreter's shutdown can abort the process.
2. :data:`LEAVE`: workers say goodbye to their aggregators.
3. :data:`STOP`: the job's own (colocated) aggregators stop, once every rank's workers have left them
   (they wait a few seconds for the other ranks', unless the script ended with an exception).

Within a stage the part registered last goes first. The one handler is registered again at every
:func:`at_exit`, so it runs before any other library's handler registered before that moment, as
the parts' own handlers did. A part that fails to close is logged; the others still close.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

RELEASE, LEAVE, STOP = 0, 1, 2

log = logging.getLogger("omnireduce")
_lock = threading.Lock()
_order = itertools.count()
_parts: list[tuple[int, int, Callable[..., Any], tuple[Any, ...]]] = []


def at_exit(stage: int, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(*args)`` at interpreter exit, in ``stage`` (:data:`RELEASE`, :data:`LEAVE` or :data:`STOP`)."""
    if stage not in (RELEASE, LEAVE, STOP):
        raise ValueError(f"exit stage must be RELEASE, LEAVE or STOP (0, 1, 2), got {stage!r}")
    with _lock:
        _parts.append((stage, -next(_order), fn, args))
        atexit.unregister(_run)
        atexit.register(_run)


def _run() -> None:
    with _lock:
        parts = sorted(_parts, key=lambda p: p[:2])
        _parts.clear()
    for _stage, _, fn, args in parts:
        try:
            fn(*args)
        except Exception as e:  # (the other parts still close)
            log.warning("omnireduce: at exit, %s failed: %s", getattr(fn, "__qualname__", fn), e)
