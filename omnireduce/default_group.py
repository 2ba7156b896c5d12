"""Keep torch itself from holding the program's default process group past its end.

``torch.distributed.nn.functional`` gives its collective functions ``group=group.WORLD`` as a default
argument, evaluated once, when the module is first imported. Imported after ``init_process_group()``
(torch's profiler imports it the first time it starts, through ``torch._inductor``), those defaults
hold the default group for ever: ``destroy_process_group()`` cannot free it, its Gloo threads live
into the interpreter's shutdown, and one that is still dropping its last collective's tensors there
cannot take the GIL: the process aborts ("terminate called without an active exception") after a
complete run. Plain torch does this too (docs/reference/reliability.md).

So where omnireduce's torch side is imported before any process group exists, it imports that
module first (:func:`guard`): its defaults are then None, which means the default group at each call,
as the defaults mean. Where it comes too late for that, at exit (:func:`let_go`) it sets to None the
defaults that still hold a group the program has destroyed, so the group is freed while the
interpreter is whole (freeing a group joins its threads with the GIL let go).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import sys
import threading
import types

log = logging.getLogger("omnireduce")
MODULE = "torch.distributed.nn.functional"
_lock = threading.Lock()
_guarded = False


def guard() -> None:
    """Import :data:`MODULE` now if torch has no default process group yet, and let go of what its
    defaults hold at exit (:func:`let_go`). Once per process; does nothing without torch.distributed."""
    global _guarded
    with _lock:
        if _guarded:
            return
        _guarded = True
    import torch.distributed as dist

    if not dist.is_available():
        return
    if not dist.is_initialized() and MODULE not in sys.modules:
        with contextlib.suppress(Exception):  # (a torch without it: nothing to keep from holding the group)
            importlib.import_module(MODULE)
    atexit.register(let_go)


def let_go() -> int:
    """Set to None each default argument of :data:`MODULE`'s functions that holds a process group
    torch no longer has as its default group (the program destroyed it); how many functions had one."""
    module = sys.modules.get(MODULE)
    if module is None:
        return 0
    import torch.distributed as dist

    current = dist.group.WORLD if dist.is_initialized() else None
    stale = [fn for fn in vars(module).values() if isinstance(fn, types.FunctionType) and fn.__defaults__
             and any(_is_stale(d, current) for d in fn.__defaults__)]
    for fn in stale:
        fn.__defaults__ = tuple(None if _is_stale(d, current) else d for d in fn.__defaults__ or ())
    if stale:
        log.debug("let go of a destroyed process group held by %d defaults of %s", len(stale), MODULE)
    return len(stale)


def _is_stale(value: object, current: object) -> bool:
    import torch.distributed as dist

    return isinstance(value, dist.ProcessGroup) and value is not current
