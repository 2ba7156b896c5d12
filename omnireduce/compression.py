"""Block sparsification with error feedback: make dense gradients sparse, in blocks, and keep convergence.

A bucket of ``n`` gradient values is cut into ``nb = ceil(n / B)`` blocks of ``B`` values (the last
one padded with zeros). Each step, per bucket and rank:

1. error feedback: the gradient is added to a float32 residual (the accumulator), on the bucket's device;
2. selection: ``k = ceil(density * nb)`` blocks are chosen from block scores (squared L2 norms of the
   accumulator's blocks). With ``selection="shared"`` the scores are summed over ranks first (an
   all-reduce of ``nb`` floats, 1/B of the bucket), so every rank takes the same top-k: the union of
   the ranks' blocks is exactly ``k``, and a dense all-reduce of the ``k * B`` compacted values is a
   valid sparse all-reduce. With ``selection="stale"`` the scores are the summed scores of the
   previous step, carried by the previous step's all-reduce of the values (no collective of their own);
3. the chosen blocks are copied out (``k * B`` float32 values) and zeroed in the accumulator: what was
   not sent stays in the residual for the next step.

:class:`BucketCompressor` is device-agnostic torch code with no process-group calls: the shared
selection takes the summed scores from its caller (:mod:`omnireduce.ddp.paths.compressed`, for the DDP
communication hook). ``k`` is known from the density, so on CUDA every tensor has a size known in
advance: no host synchronisation anywhere (top-k, index_select, index_fill and index_copy all run
on the device).

Non-finite gradients (NaN, Inf): a block holding one has a non-finite score, which ``topk`` ranks
above every finite score, so it is sent (when at most ``k`` blocks are non-finite): the reduced
gradient holds NaN/Inf as plain DDP's would, and ``torch.amp.GradScaler`` skips the step. When the
summed scores hold any non-finite value, the whole residual is reset to zero on every rank (the step's
gradient is dropped, as the scaler drops it), so one bad step does not poison later ones.
"""

from __future__ import annotations

import dataclasses
import math

import torch

#: Selections whose chosen blocks are identical on every rank (a dense all-reduce of the compacted
#: blocks is valid). "local" and "threshold" (measured in scripts/bench_compression_selection.py) are not.
SELECTIONS = ("shared", "stale")


@dataclasses.dataclass(frozen=True)
class BlockTopK:
    """Options of block top-k sparsification with error feedback (one instance per job).

    Attributes:
        density: fraction of each bucket's blocks sent per step (0 < density <= 1). ``k =
            ceil(density * nb)`` blocks of a bucket of ``nb`` blocks, at least one. ``density=1`` sends
            every block every step: the result equals plain DDP's.
        block_size: values per block ``B``. The selection's scores are ``nb = n / B`` floats, so the
            shared selection's extra all-reduce moves 1/B of the bucket; blocks of a few hundred values
            are what omnireduce's wire, kernels and aggregators move best.
        warmup_steps: optimizer steps (counted on the last bucket of each backward) sent dense before
            compression starts, as in DGC: the first steps' gradients are large and change fast. Also
            covers DDP's bucket rebuild after its first iteration. Residuals are untouched while warming up.
        selection: how blocks are chosen: ``"shared"`` (default) all-reduces the block scores and
            takes the same top-k on every rank, so the union is exactly ``k``; ``"stale"`` uses the
            previous step's summed scores, piggybacked on the previous step's all-reduce of the values
            (one collective per bucket and step instead of two; the first compressed step is shared).
            The measured comparison, including rank-local top-k and a DCT-style threshold, is in
            docs/log/data/compression_selection.json.
        min_numel: buckets with fewer values than this are sent dense every step (small buckets of
            biases and norms cost little and the extra score all-reduce would be pure latency).
        min_blocks: each compressed step sends at least this many blocks of a bucket, and all of a
            bucket with fewer (8 blocks of 256 float32 values: 8 KiB, a size the wire's latency
            prices, not its rate). At density 0.01 it changes only buckets under 800 blocks. Without it
            the recommender's bucket of 8 blocks (its bottom MLP) sends one block a step, and most of
            its loss against dense training comes from that (measured: docs/howto/compression.md).
        ramp_steps: after the warm-up, the density falls geometrically from ``ramp_from`` to ``density``
            over this many steps (DGC's exponential warm-up of the sparsity), so that the residuals fill
            gradually instead of all at once (measured in docs/howto/compression.md: it narrows the
            language models' gap to dense training). 0: ``density`` from the first compressed step.
        ramp_from: the density of the first compressed step of the ramp.
        exact_below: with ``OmniReduceState(compression=...)`` only: a bucket whose union density
            (the fraction of its blocks non-zero on some rank, measured by omnireduce during the
            warm-up) is at most this when its compression would start is never compressed:
            omnireduce's sparse path already sends it exactly at that density (an embedding table's
            bucket, typically). 0 compresses every bucket.
    """

    density: float = 0.01
    block_size: int = 256
    warmup_steps: int = 50
    selection: str = "shared"
    min_numel: int = 0
    min_blocks: int = 8
    ramp_steps: int = 100
    ramp_from: float = 0.25
    exact_below: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.warmup_steps < 0 or self.min_numel < 0 or self.min_blocks < 0:
            raise ValueError("warmup_steps, min_numel and min_blocks must be >= 0")
        if self.ramp_steps < 0 or not 0.0 < self.ramp_from <= 1.0:
            raise ValueError(f"ramp_steps must be >= 0 and ramp_from in (0, 1], got {self.ramp_steps} and "
                             f"{self.ramp_from}")
        if not 0.0 <= self.exact_below <= 1.0:
            raise ValueError(f"exact_below must be in [0, 1], got {self.exact_below}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")

    def blocks(self, numel: int) -> tuple[int, int]:
        """``(nb, k)``: the number of blocks of a bucket of ``numel`` values and how many are sent."""
        nb = -(-numel // self.block_size)
        return nb, min(nb, max(1, self.min_blocks, math.ceil(self.density * nb - 1e-9))) if nb else 0

    def density_at(self, step: int) -> float:
        """The density of compressed step ``step`` (0: the first after the warm-up): the ramp's, then ``density``."""
        if step >= self.ramp_steps or self.ramp_from <= self.density:
            return self.density
        t = step / self.ramp_steps
        return self.ramp_from ** (1.0 - t) * self.density ** t

    def k_at(self, nb: int, step: int) -> int:
        """How many of ``nb`` blocks compressed step ``step`` sends (at least ``k``, at most ``nb``)."""
        return min(nb, max(1, self.min_blocks, math.ceil(self.density_at(step) * nb - 1e-9))) if nb else 0


class BucketCompressor:
    """Error feedback and block selection for one bucket (one rank's view; no collectives here).

    ``residual`` is a float32 tensor of ``nb * B`` values (the padding stays zero) on the bucket's device.
    A step is ``accumulate(grad)``, then either ``select(summed_scores)`` (``scores()`` summed over ranks
    by the caller) or ``select_stale()``, then ``compact(idx)`` (the values to all-reduce), then, on
    the reduced values, ``scatter(values, idx, out)``.
    """

    def __init__(self, numel: int, options: BlockTopK, device: torch.device | str = "cpu") -> None:
        self.numel = numel
        self.options = options
        self.B = options.block_size
        self.nb, self.k = options.blocks(numel)
        self.residual = torch.zeros(self.nb * self.B, dtype=torch.float32, device=device)
        #: the previous step's summed scores (selection="stale"), None before the first compressed step
        self.stale_scores: torch.Tensor | None = None
        self.steps = 0
        self._bad: torch.Tensor | None = None  # set by select(): the summed scores hold NaN/Inf
        self._empty = True  # the residual is all zero (flush_into emptied it; nothing accumulated since)

    @property
    def dense(self) -> bool:
        """Every block is sent every step (density 1, or a bucket of at most one block)."""
        return self.k == self.nb

    def _blocks(self) -> torch.Tensor:
        return self.residual.view(self.nb, self.B)

    def accumulate(self, grad: torch.Tensor, inv_scale: torch.Tensor | None = None) -> None:
        """Add the bucket's gradient (any float dtype, ``numel`` values) to the residual, in float32.

        ``inv_scale`` (a 0-d tensor, e.g. ``1 / GradScaler``'s scale) keeps the residual in unscaled
        units, so a changing loss scale does not mix scales in it; :meth:`compact` then takes ``scale``.
        """
        flat = grad.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"bucket has {flat.numel()} values, compressor was made for {self.numel}")
        head = self.residual[: self.numel]
        self._empty = False
        if inv_scale is None:
            head.add_(flat)
        else:
            head.addcmul_(flat.to(torch.float32), inv_scale.to(torch.float32))
        self.steps += 1

    def put(self, offset: int, values: torch.Tensor) -> None:
        """Write ``values`` into the residual at ``offset`` (a parameter's part, handed over after DDP
        rebuilt its buckets or from a checkpoint)."""
        self.residual[offset: offset + values.numel()].copy_(values.reshape(-1))
        self._empty = False

    def flush_into(self, grad: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Add the residual to the bucket's gradient ``grad`` (times ``scale``, the loss scale, when
        :meth:`accumulate` takes one) and empty it: the bucket then goes whole, as DDP would send it.
        Free once the residual is empty (known on the host: nothing is read from the device)."""
        if self._empty:
            return
        res = self.residual[: self.numel]
        flat = grad.reshape(-1)
        flat.add_(res if scale is None else res * scale.to(torch.float32))
        self.residual.zero_()
        self._empty = True

    def scores(self) -> torch.Tensor:
        """Squared L2 norm of each block of the accumulator (``nb`` float32 values)."""
        return self._blocks().square().sum(dim=1)

    def select(self, summed_scores: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """The ``k`` (default: :attr:`k`) blocks with the largest scores, in ascending order (int64 indices).

        Given the same ``summed_scores`` every rank returns the same indices. A non-finite score
        (the bucket holds NaN/Inf somewhere on some rank) resets the residual after :meth:`compact`.
        """
        k = self.k if k is None else k
        if self.dense or k >= self.nb:
            return torch.arange(self.nb, device=self.residual.device)
        self._bad = ~torch.isfinite(summed_scores).all()
        # NaN scores compare as largest in topk, Inf next: non-finite blocks are sent first
        idx = torch.topk(summed_scores, k, sorted=False).indices
        return torch.sort(idx).values

    def select_stale(self, k: int | None = None) -> torch.Tensor | None:
        """Select with the previous step's summed scores; None when there are none yet (select shared)."""
        if self.stale_scores is None:
            return None
        return self.select(self.stale_scores, k)

    def compact(self, idx: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The chosen blocks' values (``(k, B)`` float32, a new tensor); they are zeroed in the residual.

        ``scale``: multiply the values by it (the loss scale, when :meth:`accumulate` took ``inv_scale``).
        """
        blocks = self._blocks()
        values = blocks.index_select(0, idx)
        blocks.index_fill_(0, idx, 0.0)
        if self._bad is not None:
            # a non-finite step: drop the whole residual (torch.where keeps this on the device)
            torch.where(self._bad, torch.zeros((), device=blocks.device), self.residual, out=self.residual)
            self._bad = None
        return values if scale is None else values.mul_(scale.to(torch.float32))

    def scatter(self, values: torch.Tensor, idx: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """Write reduced compacted ``values`` (``(k, B)``) into the dense bucket ``out``; zero elsewhere.
        When every block is sent (:attr:`dense`, or ``idx`` holds all ``nb``, in order), ``values`` is the
        bucket itself."""
        flat = out.reshape(-1)
        if self.dense or (idx is not None and idx.numel() == self.nb):
            flat.copy_(values.reshape(-1)[: self.numel])
            return out
        if idx is None:
            raise ValueError("scatter of a compressed bucket needs the selected blocks' indices (idx)")
        full = torch.zeros(self.nb, self.B, dtype=torch.float32, device=values.device)
        full.index_copy_(0, idx, values.reshape(-1, self.B).to(torch.float32))
        flat.copy_(full.reshape(-1)[: self.numel])
        return out

    def residual_norm(self) -> torch.Tensor:
        """The residual's L2 norm (a 0-d tensor on the bucket's device; reading it synchronises)."""
        return torch.linalg.vector_norm(self.residual)

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """The residual (on the CPU, ``numel`` values) and the step count."""
        return {"residual": self.residual[: self.numel].detach().cpu().clone(), "steps": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict`'s residual (it must have ``numel`` values)."""
        res = sd["residual"].reshape(-1)
        if res.numel() != self.numel:
            raise ValueError(f"residual has {res.numel()} values, bucket has {self.numel}")
        self.residual.zero_()
        self.residual[: self.numel].copy_(res)
        self._empty = False
        self.steps = int(sd.get("steps", 0))
        self.stale_scores = None
