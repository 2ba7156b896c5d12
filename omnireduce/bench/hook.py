"""The DDP hook's collective engine on the benchmark's tensor, timed inside DDP (``--vs-hook``).

A DDP model of one parameter the size of the tensor, whose gradient is the tensor itself (the loss is
the parameter's dot product with it), with :func:`omnireduce.ddp.omnireduce_hook` and
``OmniReduceState(engine="collective", path="omnireduce")``: every backward pass hands DDP's one bucket
to the hook, which sends it through the collective engine. The time is the hook's own: from DDP's
call of the hook until the future it returned completes (what the engine costs through the hook: the
dispatch, the route, the engine, the recording), not the backward pass around it. DDP averages, so
the functional call it is compared with is timed with ``op=AVG`` (``--vs-hook`` sets it).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real dist.GradBucket
# and torch.futures.Future[torch.Tensor] objects.
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.bench.timing import Run
from omnireduce.ddp import OmniReduceState, omnireduce_hook


class _Dot(torch.nn.Module):
    def __init__(self, numel: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel, device=device, dtype=dtype))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.w * g).sum()


class HookBench:
    """DDP models with the hook, one per tensor shape (see the module)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._models: dict[tuple[int, torch.dtype], Any] = {}
        self._states: list[OmniReduceState] = []
        self.started = self.ended = 0.0
        self._done = threading.Event()  # the hook's future has completed (its callback may run after DDP's wait)

    def _model(self, numel: int, dtype: torch.dtype) -> Any:
        key = (numel, dtype)
        if key not in self._models:
            ddp = torch.nn.parallel.DistributedDataParallel(
                _Dot(numel, self.device, dtype), bucket_cap_mb=max(25, 2 * numel * 4 / 2**20),
                device_ids=[self.device] if self.device.type == "cuda" else None)
            state = OmniReduceState(engine="collective", path="omnireduce")
            self._states.append(state)

            def timed(s: OmniReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                self._done.clear()
                self.started = time.perf_counter()
                fut = omnireduce_hook(s, bucket)
                fut.add_done_callback(self._ended)
                return fut

            ddp.register_comm_hook(state, timed)
            self._models[key] = ddp
        return self._models[key]

    def _ended(self, _fut: Any) -> None:
        self.ended = time.perf_counter()
        self._done.set()

    def _took(self) -> float:
        if not self._done.wait(60.0):
            raise RuntimeError("omnireduce-bench: the DDP hook's future did not complete")
        return self.ended - self.started

    def run_for(self, x: torch.Tensor) -> "Run":
        """A timed run: a backward pass of the model for ``x``'s shape with ``x`` as the gradient; its time the
        hook's."""
        model = self._model(x.numel(), x.dtype)

        def step(g: torch.Tensor) -> None:
            model.zero_grad(set_to_none=True)
            model(g).backward()

        def grad() -> torch.Tensor:
            g = model.module.w.grad
            return g if g is not None else torch.full_like(x, float("nan"))

        return Run(step, x, clock=self._took, result=grad)

    def bytes_sent(self) -> int:
        """Bytes this rank sent through the hook so far (every model's)."""
        return sum(int(s.stats().get("bytes_sent", 0)) for s in self._states)
