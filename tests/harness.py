"""Test harness: long-lived worker processes and deterministic block-sparse inputs.

:class:`RankPool` spawns N real processes once per test session; each test sends them commands
(join a job at these aggregator addresses as rank r of W, reduce these cases) over pipes, so the
cost of importing numpy, zmq and torch is paid once. Every reduction goes through real
``omnireduce.Worker`` objects and real zmq sockets to real aggregators.

Inputs are generated from ``(case, rank)`` alone (:func:`make_input`), so the parent process can
compute the float64 reference independently of anything the workers did.

Also shared by the tests: :data:`AGG`, :func:`start_aggregator` and :func:`stop_process` (an
``omnireduce-agg`` process on 127.0.0.1, through :mod:`omnireduce.launch.procs`), :class:`RankThreads` /
:func:`run_in_threads` (in-process ranks as threads), :func:`drop_results` (an in-process
aggregator that loses some results) and :func:`wait_for`. Ports: :func:`omnireduce.launch.procs.free_port`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import multiprocessing as mp
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from omnireduce.dtypes import bf16_to_f32, f32_to_bf16
from omnireduce.launch import procs

#: The ``omnireduce-agg`` console script of the interpreter running the tests.
AGG = str(Path(sys.executable).with_name("omnireduce-agg"))

SPECIALS = (np.nan, np.inf, -np.inf, -0.0)


@dataclasses.dataclass(frozen=True)
class Case:
    """One tensor to reduce: its size, element type, sparsity pattern and special values."""

    numel: int
    dtype: str = "float32"  # float32 | float16 | bfloat16
    density: float = 0.1
    placement: str = "random"  # random | overlap (same blocks on every rank) | tail-one (rank 0 alone has the last)
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
    if case.placement == "tail-one" and 0 < k < nb:  # rank 0's first block the last (short) one; nobody else's
        rest = pick.choice(nb - 1, size=k - 1 if rank == 0 else k, replace=False)
        blocks = np.concatenate([[nb - 1], rest]) if rank == 0 else rest
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
# Below its normal range a dtype's spacing is absolute: a sum rounded there, and rounded again when
# averaged, is off by up to one subnormal step whatever its magnitude.
SUBNORMAL_STEP = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}


UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def assert_matches(case: Case, world_size: int, got: np.ndarray, *, average: bool = False,
                   roundings: int = 0) -> None:
    """``got`` equals the float64 sum, rounded to the case's dtype, within that dtype's tolerance.

    Tolerance is relative to the sum of magnitudes (so cancellation is judged fairly); NaN must be
    NaN where the reference is NaN, and infinities must match exactly. ``roundings``: for a sum
    taken in the dtype itself (a backend's all-reduce in its order: each of its W - 1 additions, and
    the averaging, rounds to the dtype), how many times it may round; each is up to a unit roundoff
    of the sum of magnitudes, and the tolerance is the larger of that bound and the dtype's own.
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
    rtol = max(RTOL[case.dtype], roundings * UNIT_ROUNDOFF[case.dtype])
    tol = rtol * mag[fin] + max(1, roundings) * SUBNORMAL_STEP[case.dtype]
    worst = np.argmax(err - tol) if err.size else 0
    assert (err <= tol).all(), (f"{case}: max error {err[worst]:.3g} > tolerance {tol[worst]:.3g} at "
                                f"{np.flatnonzero(fin)[worst]} (got {got[fin][worst]}, want {ref[fin][worst]})")


# -- the rank pool -------------------------------------------------------------------------------

STACKS_AFTER = 240.0  # seconds (the suite's pytest-timeout: 300)


def _rank_main(conn: Any) -> None:
    import logging

    import omnireduce

    try:  # the torch-free test runs have no torch: their commands reduce numpy arrays
        import torch
    except ModuleNotFoundError:
        pass
    else:
        torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    faulthandler.enable(all_threads=True)  # a fatal signal (an abort, a segfault) prints every thread's stack
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        # a command still running after STACKS_AFTER seconds prints every thread's stack to stderr (the
        # test's captured output), before pytest-timeout ends the test: where a rank hangs, not only that
        faulthandler.dump_traceback_later(STACKS_AFTER, exit=False)
        try:
            conn.send(("ok", _run_command(omnireduce, cmd)))
        except BaseException as e:  # report, never die
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()


def _run_command(omnireduce: Any, cmd: dict[str, Any]) -> Any:
    import gc
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
        # What a command leaves in reference cycles (DDP's reducers, process groups with their backend
        # threads: a third of a DDP command's threads outlive it until a collection) is destroyed here,
        # between commands, on this thread. Left to the collector, it went at whatever allocation of a
        # later command crossed the threshold, on whatever thread made it, a backend's included, while
        # that command's collectives ran; full runs then lost rank processes to heap corruption (glibc:
        # "unaligned tcache chunk") or hung at a command's start, never a file run alone (which part of
        # torch or Gloo that late destruction trips is not shown: docs/log/2026-11-28-engine-memory.md).
        gc.collect()


def _execute(omnireduce: Any, cmd: dict[str, Any]) -> Any:
    if "call" in cmd:  # "module:function", called with the rank and the keyword arguments
        import importlib

        module, _, name = cmd["call"].partition(":")
        return getattr(importlib.import_module(module), name)(cmd["rank"], **cmd["kwargs"])
    kwargs = cmd["worker"]
    try:
        w = omnireduce.Worker(**kwargs)
    except Exception as e:  # construction errors are results too (refused, timed out, ...)
        return {"results": [("error", type(e).__name__, str(e), time.time())], "stats": {}, "constructed": False}
    with w:
        before = w.stats()
        results: list[Any] = []
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
    """``size`` long-lived worker processes that run reduction commands.

    Each process has at most one command outstanding. :meth:`collect` reads the reply of every
    rank it is asked for (or restarts the processes that do not answer), so no reply is ever left
    queued for a later test; :meth:`drain` does the same for commands nobody collected (a test that
    failed between :meth:`submit` and :meth:`collect`)."""

    def __init__(self, size: int) -> None:
        self._ctx = mp.get_context("spawn")
        self._conns: list[Any] = [None] * size
        self._procs: list[Any] = [None] * size
        self._pending: set[int] = set()  # processes with a command whose reply was not read yet
        for i in range(size):
            self._spawn(i)

    def _spawn(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_rank_main, args=(child,), daemon=True)
        p.start()
        child.close()
        self._conns[i], self._procs[i] = parent, p

    def _restart(self, i: int) -> None:
        """Replace process ``i`` (it did not answer, or died): whatever it would still send is lost."""
        self._procs[i].kill()
        self._procs[i].join(10)
        self._conns[i].close()
        self._spawn(i)
        self._pending.discard(i)

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
        self.drain()
        cmd_opts = {k: options.pop(k) for k in ("mode", "average", "env", "stop_on_error", "verify") if k in options}
        for i, rank in enumerate(ranks):
            worker = {"aggregators": addresses, "rank": rank, "world_size": world_size, "job": job,
                      "timeout": 30.0, **options, **(per_rank or {}).get(rank, {})}
            mine = cases[rank] if isinstance(cases, dict) else cases
            self._send(i, {"worker": worker, "cases": [dataclasses.asdict(c) for c in mine], **cmd_opts})
        return ranks

    def _send(self, i: int, cmd: dict[str, Any]) -> None:
        self._conns[i].send(cmd)
        self._pending.add(i)

    def _read(self, indices: list[int], timeout: float) -> dict[int, tuple]:
        """The reply of each process in ``indices`` (one deadline for all); ("timeout",) for those that
        did not answer in time (their C stacks written to stderr first) and ("died", exit code) for
        those that died; both kinds are restarted."""
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple] = {}
        for i in indices:
            try:
                if self._conns[i].poll(max(0.0, deadline - time.monotonic())):
                    replies[i] = self._conns[i].recv()
                    self._pending.discard(i)
                    continue
                replies[i] = ("timeout",)
                sys.stderr.write(native_stacks(self._procs[i].pid))
            except (EOFError, OSError):
                self._procs[i].join(5)
                replies[i] = ("died", self._procs[i].exitcode)
            self._restart(i)
        return replies

    def collect(self, ranks: list[int], timeout: float = 180.0) -> list[dict[str, Any]]:
        """The results of the command :meth:`submit` gave ``ranks``, in that order. Waits (at most
        ``timeout`` seconds in all) for every rank's reply before raising about any of them."""
        replies = self._read(list(range(len(ranks))), timeout)
        problems = []
        for i, rank in enumerate(ranks):
            reply = replies[i]
            if reply[0] == "timeout":
                problems.append(f"rank {rank} did not answer within {timeout} s (its process was restarted)")
            elif reply[0] == "died":
                problems.append(f"rank {rank}: its process died, exit code {reply[1]} (restarted; its stderr is "
                                "in the test's captured output)")
            elif reply[0] != "ok":
                problems.append(f"rank {rank} failed: {reply[1]}: {reply[2]}\n{reply[3]}")
        if problems:
            kind = TimeoutError if any(r[0] in ("timeout", "died") for r in replies.values()) else AssertionError
            raise kind("\n".join(problems))
        return [replies[i][1] for i in range(len(ranks))]

    def drain(self, timeout: float = 5.0) -> int:
        """Read and drop the replies of commands nobody collected (waiting at most ``timeout``
        seconds; processes still busy then are restarted). Returns how many were pending."""
        pending = sorted(self._pending)
        if pending:
            self._read(pending, timeout)
        return len(pending)

    def call(self, target: str, world_size: int, *, timeout: float = 300.0, env: dict[str, str] | None = None,
             **kwargs: Any) -> list[Any]:
        """Run ``target`` ("module:function") as ``function(rank, **kwargs)`` in ranks 0..world_size-1,
        with ``env`` set in their environment for the call."""
        assert world_size <= self.size, f"pool has {self.size} processes, {world_size} ranks asked"
        self.drain()
        for rank in range(world_size):
            self._send(rank, {"call": target, "rank": rank, "env": env or {},
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


# Gloo's line on stdout at each connection of a process group (torch 2.8 to 2.10; 2.11 and later print none): not
# the tested process's own output
GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                            r"Expected number of connected peer ranks is : \d+$")


def own_output(stdout: str) -> str:
    """A one-rank process's stdout without Gloo's connection lines (:data:`GLOO_CONNECTED`)."""
    return "".join(line for line in stdout.splitlines(keepends=True) if not GLOO_CONNECTED.match(line.rstrip("\n")))


def native_stacks(pid: int, timeout: float = 60.0) -> str:
    """Every thread's C stack in process ``pid`` (gdb, where there is one): what a hung rank's
    Python stacks cannot show (a thread waiting for the GIL, a lock, a collective)."""
    import shutil

    gdb = shutil.which("gdb")
    if gdb is None:
        return f"(no gdb: no C stacks of process {pid})\n"
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(gdb on process {pid}: {e})\n"
    return f"~~~~ C stacks of rank process {pid} ~~~~\n{out.stdout}{out.stderr[-2000:]}\n"


def device_path_active(rank: int, world_size: int) -> bool:
    """(Run in a rank with :meth:`RankPool.call`.) Whether a CPU torch tensor takes the device path
    (``OMNIREDUCE_DEVICE_PATH``) in this process: it is adapted to a device source."""
    import torch

    from omnireduce.sources.adapt import adapt
    from omnireduce.sources.device import DeviceSource

    return isinstance(adapt(torch.zeros(4)), DeviceSource)


# -- aggregator processes, threads as ranks, lossy aggregators ------------------------------------

_ADDRESS = re.compile(r"tcp://127\.0\.0\.1:(\d+)")


def start_aggregator(port: int = 0, *args: str, stderr: int | IO[Any] | None = subprocess.DEVNULL,
                     log_level: str = "WARNING", retry_seconds: float = 10.0) -> tuple[subprocess.Popen, str]:
    """Start ``omnireduce-agg --listen tcp://127.0.0.1:PORT --log-level LOG_LEVEL ARGS`` (the command
    line of :func:`omnireduce.launch.procs.aggregator_command`: this interpreter runs the CLI's module) with
    :func:`omnireduce.launch.procs.start_aggregator`; returns the process and the address it prints, checked
    to be 127.0.0.1 with a real port (``port`` itself unless it is 0: a free port).

    A given port may still be held for a moment after the process that had it was killed: starting
    is retried for up to ``retry_seconds``. ``stderr``: where its log goes (subprocess.PIPE, a file,
    None to inherit; default: discarded)."""
    deadline = time.monotonic() + retry_seconds
    while True:
        cmd = procs.aggregator_command(f"tcp://127.0.0.1:{port}", log_level=log_level, extra=args)
        try:
            p, address = procs.start_aggregator(cmd, stderr=stderr)
            m = _ADDRESS.fullmatch(address)
            if m and int(m.group(1)) > 0 and (port == 0 or int(m.group(1)) == port):
                return p, address
            stop_process(p)
            why = f"it listens on {address}"
        except RuntimeError as e:
            why = str(e)
        if port == 0 or time.monotonic() > deadline:
            raise RuntimeError(f"could not start an aggregator on port {port}: {why}")
        time.sleep(0.1)


def finish_session(p: subprocess.Popen[str], timeout: float) -> str:
    """The output of ``p`` (started with ``start_new_session=True``, stdout piped, text) once it exits
    with status 0; past ``timeout`` its whole session is killed and the test fails with its output."""
    import os
    import signal

    import pytest

    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{p.args} did not finish in {timeout} s:\n{out[-5000:]}")
    assert p.returncode == 0, f"{p.args} exited {p.returncode}:\n{out[-5000:]}"
    return out


def stop_process(p: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds (:func:`omnireduce.launch.procs.stop_processes`);
    returns the exit status."""
    procs.stop_processes([p], grace=timeout)
    return p.wait()


class RankThreads:
    """``fn(rank)`` for each rank, each in its own thread (in-process ranks).

    ``start()`` runs them; ``join(timeout)`` waits for all (one deadline), fails if one is still
    running and re-raises the first exception a rank raised; otherwise returns the results in rank
    order. ``results`` / ``errors`` (rank -> value / exception) can be looked at while they run."""

    def __init__(self, fn: Callable[[int], Any], ranks: int | list[int]) -> None:
        self.ranks = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
        self.fn = fn
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self._threads = [threading.Thread(target=self._main, args=(r,), name=f"rank-{r}", daemon=True)
                         for r in self.ranks]

    def _main(self, rank: int) -> None:
        try:
            self.results[rank] = self.fn(rank)
        except BaseException as e:
            self.errors[rank] = e

    def start(self) -> RankThreads:
        for t in self._threads:
            t.start()
        return self

    def finished(self, rank: int) -> bool:
        return rank in self.results or rank in self.errors

    def join(self, timeout: float = 60.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [r for r, t in zip(self.ranks, self._threads, strict=True) if t.is_alive()]
        assert not alive, f"ranks {alive} still running after {timeout} s"
        if self.errors:
            rank = min(self.errors)
            raise AssertionError(f"rank {rank} raised (errors: {self.errors})") from self.errors[rank]
        return [self.results[r] for r in self.ranks]


def run_in_threads(fn: Callable[[int], Any], ranks: int | list[int], timeout: float = 60.0) -> list[Any]:
    """``fn(rank)`` for every rank at once, each in a thread; the results in rank order (see
    :class:`RankThreads`)."""
    return RankThreads(fn, ranks).start().join(timeout)


def drop_results(agg: Any, drop: Callable[[Any, int], bool]) -> list[tuple[int, int, int]]:
    """Make the (not yet started) in-process aggregator ``agg`` lose every RESULT message for which
    ``drop(header, rank)`` is true, as if it had died just before sending it. Returns the list to
    which each lost message is added as ``(rank, seq, round)``."""
    from omnireduce.wire import MsgType, unpack_header

    lost: list[tuple[int, int, int]] = []
    core = agg.core
    deliver = core.send  # the hook every message of the aggregator leaves through

    def lossy(identity: bytes, frames: list[Any]) -> None:
        hdr = unpack_header(frames[0])
        if hdr.mtype == MsgType.RESULT:
            rank = core.registry.rank_of(identity)
            if rank is not None and drop(hdr, rank):
                lost.append((rank, hdr.seq, hdr.round))
                return
        deliver(identity, frames)

    core.send = lossy
    return lost


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something true or ``timeout`` seconds pass; returns its
    last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
