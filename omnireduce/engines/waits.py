"""Waiting on the device with a deadline, and host arrays through a process group's collectives.

Design. The collective engine's thread reads results of collectives on the host (split sizes,
sparse rows). A plain ``.cpu()`` would block that thread for ever on a collective a dead peer will
never finish, so every wait here polls a CUDA event against a deadline (:func:`poll`) and fails
with an :class:`~omnireduce.errors.OmniReduceError` naming what it waited for. NCCL moves no host
memory: :class:`Wire` stages host arrays through the tensor's device over such a group, and hands
them to the group directly where it can (Gloo, MPI, UCC).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omnireduce.errors import OmniReduceError


def poll(done: Any, timeout: float | None, what: str) -> None:
    """Wait for the CUDA event ``done`` by polling it: after ``timeout`` seconds (None: for ever) an
    :class:`OmniReduceError` naming ``what``, instead of a thread blocked on a collective that a dead
    peer will never finish."""
    start = time.monotonic()
    pause = 0.0
    while not done.query():
        waited = time.monotonic() - start
        if timeout is not None and waited > timeout:
            raise OmniReduceError(f"collective engine: {what} did not finish within {timeout:g} s: a rank has "
                                  "died or stopped calling the collectives")
        time.sleep(pause)
        pause = 0.0 if waited < 0.002 else 1e-4  # (a short wait is spun: the usual case, microseconds)


def read_counts(t: torch.Tensor, timeout: float | None, what: str) -> tuple[list[int], float]:
    """The values of ``t`` on the host (:func:`to_host`), and the CPU seconds this thread spent waiting
    for them: a CUDA tensor's wait is timed, a host tensor's has nothing to wait for (0.0)."""
    if not t.is_cuda:
        return t.tolist(), 0.0
    w0 = time.thread_time()
    values = to_host(t, timeout, what).tolist()
    return values, time.thread_time() - w0


def settle(device: torch.device, timeout: float | None, what: str) -> None:
    """Wait (:func:`poll`) for what the current stream of ``device`` has been given so far, the
    collective ``what`` among it: the host may then read results without blocking."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        poll(done, timeout, what)


def to_host(t: torch.Tensor, timeout: float | None, what: str) -> torch.Tensor:
    """``t`` on the host; from a CUDA device copied without blocking and waited for by :func:`poll`."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    poll(done, timeout, what)
    return host


class Wire:
    """Host arrays through the group's collectives. Over a group without host collectives (NCCL)
    they travel through ``device`` (:meth:`on`): copied there, exchanged, copied back."""

    def __init__(self, group: Any, timeout: float | None, device: torch.device | None = None) -> None:
        self.group, self.timeout, self.device = group, timeout, device

    def on(self, device: torch.device) -> Wire:
        """This wire, through ``device`` where the group cannot move host memory."""
        if device.type == "cpu" or host_collectives(self.group):
            return self
        return Wire(self.group, self.timeout, device)

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.device is not None else t

    def _back(self, t: torch.Tensor, what: str) -> np.ndarray:
        return to_host(t, self.timeout, what).numpy()

    def all_gather_ints(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` (int64, the same length on every rank), as rows in rank order."""
        t = self._out(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)))
        out = torch.empty((dist.get_world_size(self.group), t.numel()), dtype=t.dtype, device=t.device)
        dist.all_gather(list(out.unbind(0)), t, group=self.group)
        return self._back(out, "an all-gather of counts")

    def exchange(self, send: list[np.ndarray], recv_len: list[int], storage: np.dtype) -> list[np.ndarray]:
        """One ``all_to_all_single``: ``send[d]`` to rank ``d``; returns what each rank sent here
        (``recv_len[s]`` elements of ``storage`` from rank ``s``), as bytes reinterpreted."""
        item = storage.itemsize
        out_bytes = [n * item for n in recv_len]
        inp = self._out(torch.from_numpy(
            np.concatenate([np.ascontiguousarray(x).view(np.uint8).reshape(-1) for x in send])
            if send else np.zeros(0, np.uint8)))
        out = torch.empty(sum(out_bytes), dtype=torch.uint8, device=inp.device)
        dist.all_to_all_single(out, inp, out_bytes, [x.size * item for x in send], group=self.group)
        raw = self._back(out, "an all-to-all of blocks")
        parts, at = [], 0
        for n in out_bytes:
            parts.append(raw[at: at + n].view(storage))
            at += n
        return parts


def host_collectives(group: Any) -> bool:
    """Whether ``group``'s backend moves host tensors: all but NCCL alone (``"nccl"``, ``"cuda:nccl"``)."""
    backend = str(dist.get_backend(group)).lower()
    return "nccl" not in backend or any(b in backend for b in ("cpu:", "gloo", "mpi", "ucc"))
