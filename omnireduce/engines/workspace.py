"""The buffers a collective engine's reductions pass their blocks through, kept from one reduction to the
next (:class:`Workspace`).

Fresh buffers of a few megabytes each, sized by each step's counts, made a process's heap grow a
little with every step (glibc keeps what it frees, and the sizes never repeat exactly); a buffer here
only grows, to a quarter more than asked, so the memory it holds is about the largest reduction's and
stays put.

Lent host buffers. glibc gives each thread an arena of its own, and memory freed in one arena serves
no allocation of another thread's. The engine's reductions run on a thread of its own, so a buffer
it kept from one reduction to the next held memory that nothing else could use in between, however
much the training thread's heap held free (the training's own temporaries come and go there every
step); and the path choice, timing the aggregators, the collective engine and the dense all-reduce
in turn, kept every way's memory at once. So where freed heap memory stays resident
(:func:`omnireduce._malloc.heap_keeps`: no page faults when it is taken again), a host buffer of
:data:`LEND_MIN` bytes or more is *lent* for a spell of reductions (from a reduction asked for while
the engine was idle until its queue is empty again): the thread that asks for the spell's first
reduction allocates it, in its own heap, with the sizes the last spell ended with
(:meth:`Workspace.demand`), and the spell's end (:meth:`Workspace.end_spell`) lets it go there. A
buffer the spell needs and was not lent (the first spell of a bucket, a bucket larger than any
before) is mapped apart, of the size asked (the demand remembers the size asked for the reductions
that follow), and unmapped at the spell's end, so that it leaves nothing behind in the engine
thread's arena. Smaller buffers, device buffers, and buffers the heap would not keep stay as
before.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch

from omnireduce._malloc import heap_keeps

LEND_MIN = 1 << 20
"""Bytes from which a host buffer is lent for each spell (smaller ones are kept: they cost little)."""

_GRAIN = 65536  # bytes: buffer sizes are rounded up to this

Key = tuple[str, torch.device]


def mapped(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` in an anonymous private mapping of its own, unmapped once
    nothing references it (not in any arena of the heap)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(np.frombuffer(region, dtype=np.uint8))


class Workspace:
    """The buffers of one engine (see the module; its reductions run one after the other, on one
    stream): :meth:`take` a view of one, :attr:`nbytes` says how much they hold. ``lending``: host
    buffers may be lent for each spell (the engine sets it; see the module)."""

    def __init__(self, lending: bool = False) -> None:
        self.lending = lending
        self._bufs: dict[Key, torch.Tensor | None] = {}
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}  # (name, device, shape, dtype) -> a view of its buffer
        self._demand: dict[Key, int] = {}  # lent buffers: the bytes each will be lent with next
        self._spell: set[Key] = set()  # the buffers held for this spell only (lent, or mapped apart)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             slack: bool = True, reserve: int = 0) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` on ``device`` whose memory is buffer ``name``'s (its
        contents are whatever the last user left); ``slack=False`` grows it to the size asked (for
        sizes that repeat: :func:`omnireduce.engines.plan.capacity`'s classes); a buffer that grows
        takes at least ``reserve`` bytes (what the next reduction is known to ask). The same view is
        handed out again while the buffer stays (a shape that repeats costs a dictionary lookup)."""
        view = self._views.get((name, device, shape, dtype))
        if view is not None:
            return view
        n = dtype.itemsize
        for d in shape:
            n *= d
        key = (name, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            size = -(-max((n + n // 4) if slack else n, reserve) // _GRAIN) * _GRAIN
            self._drop(key)  # (the old one goes first: never both held at once)
            if self._lendable(device, size):  # mapped apart for this spell, of the size asked
                self._demand[key] = max(size, self._demand.get(key, 0))
                self._spell.add(key)
                buf = self._bufs[key] = mapped(max(-(-n // _GRAIN) * _GRAIN, _GRAIN))
            else:
                buf = self._bufs[key] = torch.empty(size, dtype=torch.uint8, device=device)
        if len(self._views) > 64:  # (shapes that never repeat: bounded)
            self._views.clear()
        view = self._views[(name, device, shape, dtype)] = buf[:n].view(dtype).view(shape)
        return view

    def _lendable(self, device: torch.device, nbytes: int) -> bool:
        return self.lending and device.type == "cpu" and nbytes >= LEND_MIN and heap_keeps(nbytes)

    def _drop(self, key: Key) -> None:
        self._bufs[key] = None
        self._spell.discard(key)
        for k in [k for k in self._views if k[:2] == key]:
            del self._views[k]

    def demand(self) -> dict[Key, int]:
        """The bytes of each buffer a spell is lent (what the last spells asked); empty when none."""
        return dict(self._demand)

    def lend(self, buffers: dict[Key, torch.Tensor]) -> None:
        """Take ``buffers`` (uint8 host tensors allocated by the thread that asked for the spell's first
        reduction, by :meth:`demand`) for this spell; one smaller than what the spell holds already
        is let go at once."""
        for key, buf in buffers.items():
            held = self._bufs.get(key)
            if held is None or held.numel() < buf.numel():
                self._drop(key)
                self._bufs[key] = buf
                self._spell.add(key)

    def end_spell(self) -> list[torch.Tensor]:
        """The spell is over: the lent and mapped buffers are no longer held (returned, for the caller
        to let go of outside its locks), their sizes remembered for the next spell's :meth:`demand`."""
        out = []
        for key in list(self._spell):
            buf = self._bufs.get(key)
            if buf is not None:
                self._demand[key] = max(buf.numel(), self._demand.get(key, 0))
                out.append(buf)
            self._drop(key)
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values() if b is not None)

    def clear(self) -> None:
        self._bufs.clear()
        self._views.clear()
        self._spell.clear()
