"""The buffers a collective engine's reductions pass their blocks through, kept from one reduction to the
next (:class:`Workspace`).

Fresh buffers of a few megabytes each, sized by each step's counts, made a process's heap grow a
little with every step (glibc keeps what it frees, and the sizes never repeat exactly); a buffer here
only grows, to a quarter more than asked, so the memory it holds is about the largest reduction's and
stays put.
"""

from __future__ import annotations

from typing import Any

import torch


class Workspace:
    """The buffers of one engine (see the module; its reductions run one after the other, on one
    stream): :meth:`take` a view of one, :attr:`nbytes` says how much they hold."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.device], torch.Tensor | None] = {}
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}  # (name, device, shape, dtype) -> a view of its buffer

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
        buf = self._bufs.get((name, device))
        if buf is None or buf.numel() < n:
            size = -(-max((n + n // 4) if slack else n, reserve) // 65536) * 65536
            buf = self._bufs[(name, device)] = None  # (the old one goes first: never both held at once)
            for key in [key for key in self._views if key[:2] == (name, device)]:
                del self._views[key]
            buf = self._bufs[(name, device)] = torch.empty(size, dtype=torch.uint8, device=device)
        if len(self._views) > 64:  # (shapes that never repeat: bounded)
            self._views.clear()
        view = self._views[(name, device, shape, dtype)] = buf[:n].view(dtype).view(shape)
        return view

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values() if b is not None)

    def clear(self) -> None:
        self._bufs.clear()
        self._views.clear()
