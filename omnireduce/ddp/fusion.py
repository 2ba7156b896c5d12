"""Optimizer fusion: step each DDP bucket's parameters as soon as its reduced gradient arrives.

    opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    ddp_model.register_comm_hook(state, fuse_optimizer(omnireduce_hook, opt))

Design. :func:`fuse_optimizer` wraps any communication hook (omnireduce's or torch's own). The
wrapped hook returns a future of its own that completes only after the bucket's parameters were
stepped, so DDP's ``backward()`` returns with every parameter updated; the step of one bucket then
overlaps the backward pass and the other buckets' communication (Jiang et al., "Optimizer Fusion",
2021). Three choices make an unmodified ``torch.optim`` optimizer usable this way:

- Steps run one at a time on one thread of the helper's own, never on the thread that completed the
  reduction (omnireduce's I/O thread must stay free to move the other buckets' blocks).
- A bucket is stepped with the optimizer's param groups temporarily restricted to the bucket's
  parameters (:func:`_step_subset`); what the step changes in a group besides its parameters (step
  counters, schedulers' learning rates) is kept. Optimizer state is per parameter, so it survives
  DDP's bucket rebuild.
- The reduced gradients are the bucket's views, swapped into ``p.grad`` only for the step
  (:func:`_swapped_grads`), whatever ``gradient_as_bucket_view`` is.

Streams. The step must not read a CUDA gradient before the stream that reduced it has written it
(omnireduce writes on a side stream and completes the hook's future when the writes are queued, not
done). The hook's future is CUDA-aware, so ``wait()`` on it makes the stepping thread's current
stream wait for the events recorded when it completed, without blocking the host; the step is then
queued on that stream, and the wrapped hook's own future, CUDA-aware too, is completed on it, so
DDP's stream in turn waits for the step. All under the bucket's device, so the stepping thread
makes no CUDA context on another GPU.

AMP. With ``scaler=`` (a ``torch.amp.GradScaler``) the per-bucket step is split: each bucket is
checked for infs/NaNs as it arrives, and all of a backward pass's buckets are stepped (or skipped, on
the device) together once its last bucket is in; see :mod:`omnireduce.ddp.fusion_amp`, which holds that
path and says which private parts of GradScaler it relies on.

Like torch's own (private) ``_hook_then_optimizer``, it cannot be combined with gradient clipping
over all parameters, since each bucket is stepped before the others are reduced. Re-exported by
:mod:`omnireduce.ddp`.
"""

# No `from __future__ import annotations` here: DDP checks the wrapped hook's annotations against the
# real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import concurrent.futures
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from omnireduce.ddp.fusion_amp import Hook, StateT, fuse_scaled
from omnireduce.engines.reducer import fail

__all__ = ["HookType", "fuse_optimizer"]

HookType = Hook[StateT]  # a DDP communication hook: (state, bucket) -> the future of the reduced bucket


def fuse_optimizer(hook: HookType[StateT], optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None = None) -> HookType[StateT]:
    """Wrap a communication hook so that each bucket's parameters are stepped by ``optimizer`` as
    soon as the bucket's reduced gradient arrives.

        opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
        ddp_model.register_comm_hook(state, fuse_optimizer(omnireduce_hook, opt))
        for batch in data:
            opt.zero_grad()
            loss_fn(ddp_model(batch)).backward()   # the parameters are updated by the time it returns
            # do NOT call opt.step() yourself

    ``optimizer`` is an ordinary ``torch.optim`` optimizer (tested with SGD with momentum, Adam and
    AdamW) over the DDP model's parameters; its state, param groups and learning-rate schedulers
    work as usual, and its state survives DDP's bucket rebuild because it is kept per parameter. The
    steps run one at a time on a thread of the helper's own, once per bucket, with the optimizer
    restricted to that bucket's parameters and their reduced gradients. Parameters the optimizer
    does not own are left alone. Like torch's own (private) ``_hook_then_optimizer``, it cannot be
    combined with gradient clipping over all parameters, since each bucket is stepped before the
    others are reduced.

    Sparse gradients (``nn.Embedding(sparse=True)``): the bucket's reduced sparse tensor is the
    gradient its parameter is stepped with. A model with sparse tables and dense layers usually
    needs two optimizers (``torch.optim.SparseAdam`` takes only sparse gradients); fuse both by
    wrapping twice, ``fuse_optimizer(fuse_optimizer(omnireduce_hook, sparse_adam), adam)``: each
    steps the parameters it owns.

    Mixed precision: pass the ``torch.amp.GradScaler`` as ``scaler=`` and an optimizer made with
    ``fused=True`` (torch's Adam, AdamW, SGD; any other raises ``ValueError`` here), then

        opt.zero_grad()
        scaler.scale(loss).backward()   # stepped, or skipped on every rank after an inf/NaN
        scaler.update()                 # do NOT call scaler.step(opt) yourself

    which trains as ``scaler.step(opt)`` without fusion would, scale updates included. The buckets
    are checked as they arrive, but stepped together when the backward pass's last bucket is in,
    since an inf anywhere must skip the whole step; the skip is decided on the device (no host
    sync). ``scaler.unscale_(opt)`` (for clipping) cannot be combined with it. A disabled scaler
    (``enabled=False``) is the same as none.
    """
    if scaler is not None and scaler.is_enabled():
        return fuse_scaled(hook, optimizer, scaler, _step_subset)
    return _fused(hook, optimizer, concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omnireduce-optimizer"))


def _fused(hook: HookType[StateT], optimizer: torch.optim.Optimizer,
           steps: concurrent.futures.Executor) -> HookType[StateT]:
    """The wrapped hook of :func:`fuse_optimizer` without a scaler: each bucket stepped on ``steps``."""

    def fused(state: StateT, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        reduced = hook(state, bucket)
        device = bucket.buffer().device
        cuda = device.type == "cuda"
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[device] if cuda else None)

        def step() -> None:
            try:
                with torch.cuda.device(device) if cuda else contextlib.nullcontext():
                    # wait(): the current stream waits for the stream that wrote the result (CUDA)
                    buffer = reduced.wait()
                    # a sparse gradient's bucket has no views: the reduced (new) tensor is the gradient
                    grads = [buffer] if buffer.layout != torch.strided else bucket.gradients()
                    _step_subset(optimizer, bucket.parameters(), grads)
                    out.set_result(buffer)  # records an event on the stream the step was queued on
            except BaseException as e:
                fail(out, e)  # (backward() raises it as it is)

        # Step on a thread of our own, not on the thread that completed the reduction (omnireduce's
        # I/O thread), which must stay free to move the other buckets' blocks.
        def submit(_f: torch.futures.Future[torch.Tensor]) -> None:
            steps.submit(step)

        reduced.add_done_callback(submit)
        return out

    return fused


def _step_subset(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``optimizer.step()`` for ``params`` only, with ``grads`` as their gradients."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    pairs = [(p, g) for p, g in zip(params, grads, strict=True) if id(p) in owned]
    if not pairs:
        return
    wanted = {id(p) for p, _ in pairs}
    with _swapped_grads(pairs):
        groups = optimizer.param_groups
        optimizer.param_groups = [dict(g, params=[p for p in g["params"] if id(p) in wanted]) for g in groups]
        try:
            optimizer.step()
        finally:
            for original, restricted in zip(groups, optimizer.param_groups, strict=True):
                for k, v in restricted.items():  # keep what step() changed (e.g. counters), not the subset
                    if k != "params":
                        original[k] = v
            optimizer.param_groups = groups


@contextlib.contextmanager
def _swapped_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    saved = [p.grad for p, _ in pairs]
    for p, g in pairs:
        p.grad = g
    try:
        yield
    finally:
        for (p, _), s in zip(pairs, saved, strict=True):
            p.grad = s
