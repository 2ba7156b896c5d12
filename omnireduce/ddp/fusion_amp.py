"""Optimizer fusion under ``torch.amp.GradScaler``: the step is decided on the device, once per backward pass.

    opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3, fused=True)
    ddp_model.register_comm_hook(state, fuse_optimizer(omnireduce_hook, opt, scaler=scaler))
    opt.zero_grad(); scaler.scale(loss).backward(); scaler.update()   # no scaler.step(opt)

Design. The gradients DDP reduces are scaled by the scaler's scale S, and a step whose gradients
hold an inf or NaN anywhere must be skipped for every parameter, so no bucket can be stepped before
the last one was checked. :func:`fuse_scaled` therefore splits :mod:`omnireduce.ddp.fusion`'s per-bucket
step in two, both on one thread of its own (never the thread that completed the reduction):

- As each bucket's reduction arrives, its gradients (those of parameters the optimizer owns) are
  checked for non-finite values with ``torch._amp_foreach_non_finite_check_and_unscale_`` into one
  found-inf flag on the device, per backward pass (a :class:`_Round`); with an inverse scale of 1,
  as ``GradScaler.step`` does for an optimizer that unscales itself, so the gradients are left as
  the unfused loop leaves them.
- When the last bucket of the backward pass (``bucket.is_last()``, DDP calls hooks in bucket order)
  has been checked, and every earlier one too, all the round's parameters are stepped in one
  ``optimizer.step()`` with ``optimizer.grad_scale`` (the scaler's scale tensor) and
  ``optimizer.found_inf`` set, exactly as ``GradScaler.step`` sets them: torch's ``fused=True``
  optimizers (``_step_supports_amp_scaling``) unscale in their kernel and skip on the device, so
  nothing waits on the host. Other optimizers are refused at wrap time (:func:`check_supported`):
  skipping them would need ``found_inf.item()``.
- The found-inf flag is then registered in the scaler as ``scaler.step(optimizer)`` would, so the
  user's ``scaler.update()`` backs off or grows the scale as usual. This relies on GradScaler's
  private parts: ``_per_optimizer_states[id(optimizer)]`` with its ``"stage"``
  (``OptState.STEPPED``) and ``"found_inf_per_device"`` entries, and ``_get_scale_async()``.

Futures. Every bucket's future completes only after the round's step (DDP's ``backward()`` returns
with the parameters updated), so the futures of the earlier buckets complete when the last bucket's
step is done. This cannot deadlock: DDP waits for the futures only after its last hook call, and
the round is settled from the reductions' completions alone. A reduction that fails (or a hook that
raises) fails every future of its round, once all of the round's buckets are accounted for.
On CUDA the checks and the step are queued on the stepping thread's current stream after it waited
(without blocking the host) for the reductions' streams, as in :mod:`omnireduce.ddp.fusion`.
"""

# No `from __future__ import annotations` here: DDP checks the wrapped hook's annotations against the
# real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import concurrent.futures
import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from omnireduce.engines.reducer import fail

__all__ = ["check_supported", "fuse_scaled"]

StepSubset = Callable[[torch.optim.Optimizer, list[torch.Tensor], list[torch.Tensor]], None]
StateT = TypeVar("StateT")  # a hook's state: whatever it was registered with (DDP takes any object)
Hook = Callable[[StateT, dist.GradBucket], torch.futures.Future[torch.Tensor]]  # a DDP communication hook


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` unless ``optimizer`` can skip a step on the device (``found_inf``)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise ValueError(
            f"fuse_optimizer(..., scaler=...) needs an optimizer that takes GradScaler's grad_scale and "
            f"found_inf and skips a step on the device; {type(optimizer).__name__} does not. Create it with "
            f"fused=True (torch.optim.Adam, AdamW or SGD), or fuse without a scaler.")


@dataclass
class _Entry:
    """One bucket of a round: its future and, once checked, what its step needs."""

    out: torch.futures.Future[torch.Tensor]
    buffer: torch.Tensor | None = None
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Round:
    """The buckets of one backward pass; ``closed`` once its last bucket's hook was called."""

    device: torch.device
    entries: list[_Entry] = field(default_factory=list)
    closed: bool = False
    accounted: int = 0  # buckets checked or failed
    error: BaseException | None = None
    found_inf: torch.Tensor | None = None  # made and used on the stepping thread only


def fuse_scaled(hook: Hook[StateT], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                step_subset: StepSubset) -> Hook[StateT]:
    """Wrap ``hook`` so that a backward pass's buckets are checked for infs as they arrive and all
    stepped (or all skipped) by ``optimizer`` once the last one is in; see the module docstring.
    ``step_subset(optimizer, params, grads)`` steps ``params`` with ``grads`` as their gradients."""
    check_supported(optimizer)
    return _ScaledFusion(hook, optimizer, scaler, step_subset).fused


class _ScaledFusion(Generic[StateT]):
    """The rounds of :func:`fuse_scaled`: one per backward pass, its buckets checked on the stepping
    thread as they arrive, settled (stepped or skipped) after its last."""

    def __init__(self, hook: Hook[StateT], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 step_subset: StepSubset) -> None:
        self.hook, self.optimizer, self.scaler, self.step_subset = hook, optimizer, scaler, step_subset
        self.steps = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omnireduce-optimizer")
        self.owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.lock = threading.Lock()
        self.current: _Round | None = None  # the open round, touched under the lock

    def account(self, r: _Round, error: BaseException | None) -> None:
        """One more bucket of ``r`` checked (or failed); settle the round after its last (stepping thread)."""
        with self.lock:
            if error is not None and r.error is None:
                r.error = error
            r.accounted += 1
            ready = r.closed and r.accounted == len(r.entries)
        if ready:
            _settle(r, self.optimizer, self.scaler, self.step_subset)

    def check(self, r: _Round, entry: _Entry, bucket: dist.GradBucket,
              reduced: torch.futures.Future[torch.Tensor]) -> None:
        error = None
        try:
            with _on(r.device):
                buffer = reduced.wait()  # CUDA: the current stream waits for the reduction's
                grads = [buffer] if buffer.layout != torch.strided else bucket.gradients()
                pairs = [(p, g) for p, g in zip(bucket.parameters(), grads, strict=True) if id(p) in self.owned]
                entry.buffer, entry.params, entry.grads = buffer, [p for p, _ in pairs], [g for _, g in pairs]
                if r.found_inf is None:
                    r.found_inf = torch.zeros((), dtype=torch.float32, device=r.device)
                _check_non_finite([g for _, g in pairs], r.found_inf)
        except BaseException as e:
            error = e
        self.account(r, error)

    def _join(self, entry: _Entry, device: torch.device, last: bool) -> _Round:
        """The round ``entry`` belongs to (a new one at a backward pass's first bucket); the last closes it."""
        with self.lock:
            r = self.current
            if r is None:
                r = self.current = _Round(device)
            r.entries.append(entry)
            if last:
                r.closed = True
                self.current = None
        return r

    def fused(self, state: StateT, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        device = bucket.buffer().device
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[device] if device.type == "cuda" else None)
        entry = _Entry(out)
        r = self._join(entry, device, bucket.is_last())
        try:
            reduced = self.hook(state, bucket)
        except BaseException as e:
            # backward fails here: no later bucket of this pass will come, so close the round
            with self.lock:
                r.closed = True
                if self.current is r:
                    self.current = None
            self.steps.submit(self.account, r, e)
            raise

        def checked(_f: torch.futures.Future[torch.Tensor]) -> None:
            self.steps.submit(self.check, r, entry, bucket, reduced)

        reduced.add_done_callback(checked)
        return out


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_non_finite(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` to 1 if any of ``grads`` holds an inf or NaN, on the device (GradScaler's check)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g.layout != torch.strided:  # sparse: check the (coalesced, as GradScaler does) values
            g = (g if g.is_coalesced() else g.coalesce())._values()
        by_dtype[g.dtype].append(g)
    one = torch.ones((), dtype=torch.float32, device=found_inf.device)  # check only: the optimizer unscales
    with torch.no_grad():
        for ts in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(ts, found_inf, one)


def _settle(r: _Round, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
            step_subset: StepSubset) -> None:
    """Step every parameter of the round at once (skipped on the device after an inf), register the
    verdict in ``scaler`` and complete the round's futures; or fail them all."""
    error = r.error
    if error is None:
        try:
            with _on(r.device):
                if r.found_inf is None:
                    r.found_inf = torch.zeros((), dtype=torch.float32, device=r.device)
                state = scaler._per_optimizer_states[id(optimizer)]
                if state["stage"] is OptState.STEPPED:
                    raise RuntimeError("the fused optimizer already stepped since the last scaler.update(): "
                                       "call scaler.update() after every backward pass")
                scale = scaler._get_scale_async()
                if scale is None:
                    raise RuntimeError("the scaler has no scale yet: scale the loss with scaler.scale(loss)")
                optimizer.grad_scale = scale  # type: ignore[attr-defined]
                optimizer.found_inf = r.found_inf  # type: ignore[attr-defined]
                try:
                    step_subset(optimizer, [p for e in r.entries for p in e.params],
                                [g for e in r.entries for g in e.grads])
                finally:
                    del optimizer.grad_scale  # type: ignore[attr-defined]
                    del optimizer.found_inf  # type: ignore[attr-defined]
                state["found_inf_per_device"] = {r.found_inf.device: r.found_inf}
                state["stage"] = OptState.STEPPED
                for entry in r.entries:  # CUDA: records an event after the step on the current stream
                    assert entry.buffer is not None  # (every entry was checked: the round has no error)
                    entry.out.set_result(entry.buffer)
                return
        except BaseException as e:
            error = e
    for entry in r.entries:
        if not entry.out.done():
            fail(entry.out, error)  # (backward() raises it as it is)
