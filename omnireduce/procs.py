"""Helpers to start and stop the aggregator processes and to pick ports.

Shared by ``omnireduce-run`` (:mod:`omnireduce.run`), :mod:`omnireduce.launch` and the benchmarks in
``scripts/``: :func:`free_port` picks a TCP port, :func:`start_aggregator` starts one
``omnireduce-agg`` and waits for the line that gives its address, and :func:`stop_processes` stops
a group of processes (SIGTERM, then SIGKILL for those still running after a shared grace period).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("omnireduce.procs")

LISTENING = "omnireduce-agg listening on "
"""What ``omnireduce-agg`` prints on standard output once it accepts connections, then its address."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (``""``: on every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stop_processes(procs: Iterable[subprocess.Popen[Any]], grace: float = 10.0) -> None:
    """Stop every process: SIGTERM to those running, then SIGKILL to those still running after ``grace`` s.

    The grace period is one deadline shared by all of them (not ``grace`` seconds each). Every
    process has been waited for (reaped) when this returns.
    """
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            try:
                p.terminate()
            except OSError as e:  # gone in between, or not ours to signal
                log.debug("could not terminate pid %d: %s", p.pid, e)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s: killing it", p.pid, grace)
            p.kill()
            p.wait()


def start_aggregator(cmd: list[str], popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen, *,
                     name: str = "aggregator", timeout: float = 60.0,
                     **popen_kwargs: Any) -> tuple[subprocess.Popen[Any], str]:
    """Start ``omnireduce-agg`` (``cmd``) with ``popen`` and return the process and the address it listens on.

    ``popen`` is ``subprocess.Popen`` or a stand-in with its signature (e.g. one that runs the
    command in a network namespace); ``popen_kwargs`` go to it, except ``stdout`` and ``text``: the
    aggregator's standard output is a text pipe, read up to the ``omnireduce-agg listening on ADDR``
    line. If that line does not come (the process exits, prints something else, or says nothing
    for ``timeout`` seconds), the process is stopped and ``RuntimeError`` is raised with what it
    printed and, when its standard error is a pipe, what it wrote there.
    """
    p = popen(cmd, stdout=subprocess.PIPE, text=True, **popen_kwargs)
    silent = threading.Event()

    def give_up() -> None:  # a silent aggregator: kill it, so that readline sees EOF
        silent.set()
        p.kill()

    try:
        timer = threading.Timer(timeout, give_up)
        timer.daemon = True
        timer.start()
        try:
            line = p.stdout.readline().strip() if p.stdout is not None else ""
        finally:
            timer.cancel()
        if line.startswith(LISTENING):
            return p, line[len(LISTENING):].strip()
        try:  # let it finish saying why (on standard error) before stopping it
            p.wait(2.0)
        except subprocess.TimeoutExpired:
            stop_processes([p], grace=5.0)
        err = ""
        if p.stderr is not None:  # a pipe (text, like stdout): the process is gone, so this ends
            with contextlib.suppress(OSError, ValueError):
                err = p.stderr.read().strip()
        said = f"printed {line!r}" if line else f"printed nothing (exit status {p.returncode})"
        if silent.is_set() and not line:
            said = f"printed nothing in {timeout:g} s"
        raise RuntimeError(f"{name} did not start: {said}" + (f": {err}" if err else ""))
    except BaseException:
        stop_processes([p], grace=5.0)
        raise
