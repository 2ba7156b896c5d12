"""Test harness: long-lived worker processes and deterministic block-sparse inputs.

:class:`RankPool` spawns N real processes once per test session; each test sends them commands
(join a job at these aggregator addresses as rank r of W, reduce these cases) over pipes, so the
cost of importing numpy, zmq and torch is paid once. Every reduction goes through real
``omnireduce.Worker`` objects and real zmq sockets to real aggregators.

Inputs are generated from ``(case, rank)`` alone (:func:`make_input`), so the parent process can
compute the float64 reference independently of anything the workers did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import traceback
from typing import Any

import numpy as np

from omnireduce.dtypes import bf16_to_f32, f32_to_bf16

SPECIALS = (np.nan, np.inf, -np.inf, -0.0)


@dataclasses.dataclass(frozen=True)
class Case:
    """One tensor to reduce: its size, element type, sparsity pattern and special values."""

    numel: int
    dtype: str = "float32"  # float32 | float16 | bfloat16
    density: float = 0.1
    placement: str = "random"  # random | overlap (same blocks on every rank)
    block_size: int = 256
    seed: int = 0
    specials: bool = False  # put NaN, Inf, -Inf and -0.0 into some non-zero blocks
    kind: str = "numpy"  # numpy | torch
    shape: tuple[int, ...] | None = None  # reshape the flat input (must have numel elements)
    small: float = 0.0  # this fraction of the non-zero blocks is scaled by 1e-3 (for thresholds)


def make_values(case: Case, rank: int) -> np.ndarray:
    """The input of ``rank`` as float32 values exactly representable in the case's dtype."""
    n, B = case.numel, case.block_size
    nb = -(-n // B)
    k = round(nb * case.density)
    pick = np.random.default_rng([case.seed, 0 if case.placement == "overlap" else rank + 1, 1])
    blocks = pick.choice(nb, size=k, replace=False) if 0 < k < nb else np.arange(nb if k else 0)
    rng = np.random.default_rng([case.seed, rank + 1, 2])
    x = np.zeros(nb * B, dtype=np.float32)
    if k:
        vals = rng.standard_normal((blocks.size, B)).astype(np.float32)
        # some zero elements inside non-zero blocks, and -0.0 among them
        vals[rng.random(vals.shape) < 0.1] = 0.0
        vals[rng.random(vals.shape) < 0.02] = -0.0
        if case.small:
            vals[rng.random(blocks.size) < case.small] *= np.float32(1e-3)
        x.reshape(nb, B)[blocks] = vals
    x = x[:n]
    if case.specials and k:
        # a few special values at random positions of non-zero blocks
        where = (blocks[rng.integers(0, blocks.size, size=8)] * B + rng.integers(0, B, size=8)).clip(0, n - 1)
        x[where] = np.array(SPECIALS * 2, dtype=np.float32)[: where.size]
        # a whole block of -0.0 on some rank: zero, never sent
        if blocks.size > 1:
            b = int(blocks[-1])
            x[b * B: min(n, (b + 1) * B)] = -0.0
    if case.dtype == "float16":
        with np.errstate(over="ignore"):
            x = x.astype(np.float16).astype(np.float32)
    elif case.dtype == "bfloat16":
        x = bf16_to_f32(f32_to_bf16(x))
    return x


def make_input(case: Case, rank: int) -> Any:
    """The tensor a rank reduces (numpy array or torch tensor of the case's dtype and shape)."""
    x = make_values(case, rank)
    shape = case.shape or (case.numel,)
    if case.kind == "torch" or case.dtype == "bfloat16":
        import torch

        t = torch.from_numpy(x.copy())
        t = t.to({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[case.dtype])
        return t.reshape(shape)
    return x.astype(case.dtype).reshape(shape)


def to_numpy(x: Any) -> np.ndarray:
    """A reduced tensor as a flat float64 array (exact for all three dtypes)."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1).astype(np.float64)
    import torch

    return x.detach().reshape(-1).to(torch.float32).numpy().astype(np.float64)


def to_bits(x: Any) -> bytes:
    """The raw bytes of a reduced tensor (for bit-for-bit comparisons)."""
    if isinstance(x, np.ndarray):
        return x.tobytes()
    import torch

    flat = x.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def reference(case: Case, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The float64 sum over ranks and the sum of magnitudes (the scale of rounding errors)."""
    xs = [make_values(case, r).astype(np.float64) for r in range(world_size)]
    with np.errstate(invalid="ignore"):
        return np.sum(xs, axis=0), np.sum(np.abs(xs), axis=0)


RTOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}


def assert_matches(case: Case, world_size: int, got: np.ndarray, *, average: bool = False) -> None:
    """``got`` equals the float64 sum, rounded to the case's dtype, within that dtype's tolerance.

    Tolerance is relative to the sum of magnitudes (so cancellation is judged fairly); NaN must be
    NaN where the reference is NaN, and infinities must match exactly.
    """
    ref, mag = reference(case, world_size)
    if average:
        ref, mag = ref / world_size, mag / world_size
    with np.errstate(over="ignore", invalid="ignore"):
        if case.dtype == "float16":
            rounded = ref.astype(np.float16).astype(np.float64)
        elif case.dtype == "bfloat16":
            rounded = bf16_to_f32(f32_to_bf16(ref.astype(np.float32))).astype(np.float64)
        else:
            rounded = ref.astype(np.float32).astype(np.float64)
    assert got.shape == ref.shape, f"shape {got.shape} != {ref.shape}"
    nan = np.isnan(rounded)
    assert np.array_equal(np.isnan(got), nan), f"NaN positions differ: {np.flatnonzero(np.isnan(got) != nan)[:10]}"
    inf = np.isinf(rounded) | np.isinf(ref)
    fin = ~nan & ~inf
    if inf.any():
        # where the exact sum overflows the dtype or is infinite, the result must be that infinity
        bad = inf & ~nan & (got != rounded)
        assert not bad.any(), f"infinities differ at {np.flatnonzero(bad)[:10]}: got {got[bad][:5]}"
    err = np.abs(got[fin] - ref[fin])
    tol = RTOL[case.dtype] * mag[fin] + 1e-30
    worst = np.argmax(err - tol) if err.size else 0
    assert (err <= tol).all(), (f"{case}: max error {err[worst]:.3g} > tolerance {tol[worst]:.3g} at "
                                f"{np.flatnonzero(fin)[worst]} (got {got[fin][worst]}, want {ref[fin][worst]})")


# -- the rank pool -------------------------------------------------------------------------------

def _rank_main(conn: Any) -> None:
    import logging

    import torch

    import omnireduce

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        try:
            conn.send(("ok", _run_command(omnireduce, cmd)))
        except BaseException as e:  # report, never die
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))


def _run_command(omnireduce: Any, cmd: dict[str, Any]) -> Any:
    import os

    saved = {k: os.environ.get(k) for k in cmd.get("env", {})}
    os.environ.update(cmd.get("env", {}))
    try:
        return _execute(omnireduce, cmd)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _execute(omnireduce: Any, cmd: dict[str, Any]) -> Any:
    if "call" in cmd:  # "module:function", called with the rank and the keyword arguments
        import importlib

        module, _, name = cmd["call"].partition(":")
        return getattr(importlib.import_module(module), name)(cmd["rank"], **cmd["kwargs"])
    kwargs = cmd["worker"]
    try:
        w = omnireduce.Worker(**kwargs)
    except Exception as e:  # construction errors are results too (refused, timed out, ...)
        import time

        return {"results": [("error", type(e).__name__, str(e), time.time())], "stats": {}, "constructed": False}
    with w:
        before = w.stats()
        results: list[Any] = []
        import time

        if cmd.get("verify"):  # all in flight at once; then check each result here against float64
            cases = [Case(**c) for c in cmd["cases"]]
            xs = [make_input(case, kwargs["rank"]) for case in cases]
            futures = [w.allreduce_async(x, average=cmd.get("average", False)) for x in xs]
            for case, x, f in zip(cases, xs, futures, strict=True):
                try:
                    f.result(300)
                    assert_matches(case, kwargs["world_size"], to_numpy(x), average=cmd.get("average", False))
                    results.append(("ok", None, None, time.time()))
                except Exception as e:
                    results.append(("error", type(e).__name__, str(e), time.time()))
            after = w.stats()
            return {"results": results, "stats": {k: after[k] - before[k] for k in after}}
        inputs = [make_input(Case(**c), kwargs["rank"]) for c in cmd["cases"]]
        outs, stamps = [], []
        if cmd.get("mode") == "async":
            futures = [w.allreduce_async(x, average=cmd.get("average", False)) for x in inputs]
            for f in futures:
                try:
                    outs.append(f.result(300))
                except Exception as e:
                    outs.append(e)
                stamps.append(time.time())
        else:
            for x in inputs:
                try:
                    outs.append(w.allreduce(x, average=cmd.get("average", False)))
                except Exception as e:
                    outs.append(e)
                stamps.append(time.time())
                if cmd.get("stop_on_error") and isinstance(outs[-1], Exception):
                    break
        for out, x, t in zip(outs, inputs, stamps, strict=False):
            if isinstance(out, Exception):
                results.append(("error", type(out).__name__, str(out), t))
            else:
                assert out is x, "allreduce must return its input"
                results.append(("ok", to_numpy(out), to_bits(out), t))
        after = w.stats()
    return {"results": results, "stats": {k: after[k] - before[k] for k in after}}


class RankPool:
    """``size`` long-lived worker processes that run reduction commands."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        for _ in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(child,), daemon=True)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)

    @property
    def size(self) -> int:
        return len(self._procs)

    def run(self, addresses: list[str], world_size: int, cases: list[Case] | dict[int, list[Case]], *, job: str,
            ranks: list[int] | None = None, timeout: float = 180.0, per_rank: dict[int, dict[str, Any]] | None = None,
            **options: Any) -> list[dict[str, Any]]:
        """Each of ``ranks`` (default all of ``world_size``) joins ``job`` and reduces ``cases``
        (a list for every rank, or a dict rank -> list).

        ``options``: ``mode`` ("sync"/"async"), ``average``, ``env`` (environment variables set in
        the rank processes for this command), and Worker keyword arguments (``block_size``,
        ``lanes``, ``slots``, ``timeout``, ``token``, ...); ``per_rank`` overrides Worker keyword
        arguments for some ranks."""
        return self.collect(self.submit(addresses, world_size, cases, job=job, ranks=ranks, per_rank=per_rank,
                                        **options), timeout=timeout)

    def submit(self, addresses: list[str], world_size: int, cases: list[Case] | dict[int, list[Case]], *,
               job: str, ranks: list[int] | None = None, per_rank: dict[int, dict[str, Any]] | None = None,
               **options: Any) -> list[int]:
        """Like :meth:`run`, but returns at once; :meth:`collect` waits for the results."""
        ranks = list(range(world_size)) if ranks is None else ranks
        assert len(ranks) <= self.size, f"pool has {self.size} processes, {len(ranks)} ranks asked"
        cmd_opts = {k: options.pop(k) for k in ("mode", "average", "env", "stop_on_error", "verify") if k in options}
        for i, rank in enumerate(ranks):
            worker = {"aggregators": addresses, "rank": rank, "world_size": world_size, "job": job,
                      "timeout": 30.0, **options, **(per_rank or {}).get(rank, {})}
            mine = cases[rank] if isinstance(cases, dict) else cases
            self._conns[i].send({"worker": worker, "cases": [dataclasses.asdict(c) for c in mine], **cmd_opts})
        return ranks

    def collect(self, ranks: list[int], timeout: float = 180.0) -> list[dict[str, Any]]:
        out = []
        for i, rank in enumerate(ranks):
            if not self._conns[i].poll(timeout):
                raise TimeoutError(f"rank {rank} did not answer within {timeout} s")
            reply = self._conns[i].recv()
            if reply[0] != "ok":
                raise AssertionError(f"rank {rank} failed: {reply[1]}: {reply[2]}\n{reply[3]}")
            out.append(reply[1])
        return out

    def call(self, target: str, world_size: int, *, timeout: float = 300.0, env: dict[str, str] | None = None,
             **kwargs: Any) -> list[Any]:
        """Run ``target`` ("module:function") as ``function(rank, **kwargs)`` in ranks 0..world_size-1,
        with ``env`` set in their environment for the call."""
        assert world_size <= self.size, f"pool has {self.size} processes, {world_size} ranks asked"
        for rank in range(world_size):
            self._conns[rank].send({"call": target, "rank": rank, "env": env or {},
                                    "kwargs": {"world_size": world_size, **kwargs}})
        return self.collect(list(range(world_size)), timeout=timeout)

    def close(self) -> None:
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.send(None)
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
