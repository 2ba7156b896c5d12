"""Starting and stopping aggregator and helper processes, and picking ports: one policy for children.

Shared by ``omnireduce-run`` (:mod:`omnireduce.launch.run`), the colocated aggregators
(:mod:`omnireduce.launch.colocate`), :func:`omnireduce.launch.init_distributed`, the tests and the
benchmarks in ``scripts/``:

* :func:`aggregator_command` builds an aggregator's command line (every place that starts one uses
  it), :func:`start_aggregator` starts it and waits for the line that gives its address, and
  :func:`free_port` picks a TCP port.
* No orphans, without ``PR_SET_PDEATHSIG``: the parent stops the children it started, with
  deadlines (:func:`stop_processes`: SIGTERM, then SIGKILL for those still running after a shared
  grace period), and a child that must not outlive its parent even when the parent is SIGKILLed is
  started with ``stdin=subprocess.PIPE`` and watches that pipe: the child's half,
  :mod:`omnireduce.lifetime` (a ground-floor module, which the aggregator imports too).
  ``python -m omnireduce.aggregator.colocated`` (:data:`COLOCATED_MODULE`) is such an aggregator.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

log = logging.getLogger("omnireduce.procs")

LISTENING = "omnireduce-agg listening on "
"""What ``omnireduce-agg`` prints on standard output once it accepts connections, then its address."""

AGGREGATOR_MODULE = "omnireduce.aggregator.cli"
"""``omnireduce-agg``: a dedicated aggregator, which runs until SIGINT or SIGTERM."""

COLOCATED_MODULE = "omnireduce.aggregator.colocated"
"""An aggregator that stops with the process that started it (``stdin=subprocess.PIPE``): when that
process closes the pipe, once no worker is connected any more (``--drain`` seconds at the latest);
when it dies, at once."""

def aggregator_command(listen: str, *, module: str = AGGREGATOR_MODULE, drain: float | None = None,
                       token_file: str | os.PathLike[str] | None = None, insecure: bool = False,
                       log_level: str | None = "WARNING", log_interval: float | None = None,
                       socket_buffer: int = 0, io_threads: int | None = None,
                       extra: Sequence[str] = ()) -> list[str]:
    """The command line of one aggregator listening on ``listen`` (``tcp://HOST:PORT``; port 0: a free one).

    This interpreter runs ``module``: :data:`AGGREGATOR_MODULE` (``omnireduce-agg``) or
    :data:`COLOCATED_MODULE` (which also takes ``drain``, its seconds to wait for the workers after
    its standard input ends). The other arguments are ``omnireduce-agg`` options; those left None
    (``log_level`` None too), ``False`` or 0 (``socket_buffer``: the kernel's autotuning) are not
    passed, so the aggregator's defaults apply. ``extra``: more options, appended as given.
    """
    if drain is not None and module != COLOCATED_MODULE:
        raise ValueError(f"drain is an option of {COLOCATED_MODULE}, not of {module}")
    cmd = [sys.executable, "-m", module]
    if drain is not None:
        cmd += ["--drain", str(drain)]  # first: the colocated entry point takes it before omnireduce-agg's options
    cmd += ["--listen", listen]
    if token_file is not None:
        cmd += ["--token-file", os.fspath(token_file)]
    if insecure:
        cmd.append("--insecure")
    if log_level is not None:
        cmd += ["--log-level", log_level]
    if log_interval is not None:
        cmd += ["--log-interval", f"{log_interval:g}"]
    if socket_buffer > 0:
        cmd += ["--socket-buffer", str(socket_buffer)]
    if io_threads is not None:
        cmd += ["--io-threads", str(io_threads)]
    return [*cmd, *extra]


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
