"""The aggregator's health probe (``omnireduce-agg --check``) against real aggregators and impostors."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

import omnireduce
from omnireduce.aggregator.cli import main as agg_main
from omnireduce.aggregator.health import check


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_running_aggregator_is_healthy_and_the_probe_leaves_no_trace():
    with omnireduce.Aggregator() as agg:
        for _ in range(30):  # more than the per-connection error rate limit would let through
            h = check(agg.address, timeout=5.0)
            assert h.ok, h.message
            assert "healthy" in h.message
        assert agg.gauges()["jobs"] == 0
        assert agg.counters["errors_suppressed"] == 0


def test_nothing_listening_fails_fast_and_says_so():
    address = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    h = check(address, timeout=5.0)
    assert not h.ok
    assert "cannot connect" in h.message and address in h.message
    assert time.monotonic() - t0 < 2.0


@pytest.fixture()
def router():
    """A bound ROUTER socket playing a broken aggregator: it accepts connections, answers as told."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(0)
    ctx.term()


def test_a_stuck_loop_is_unhealthy_although_its_port_accepts(router):
    _sock, address = router  # bound, never read: what a wedged event loop looks like from outside
    t0 = time.monotonic()
    h = check(address, timeout=0.5)
    assert not h.ok
    assert "no answer within 0.5 s" in h.message
    assert 0.4 < time.monotonic() - t0 < 3.0


def test_something_else_answering_is_not_an_aggregator(router):
    sock, address = router

    def answer_garbage():
        if sock.poll(5000):
            ident, *_ = sock.recv_multipart()
            sock.send_multipart([ident, b"HTTP/1.1 400 Bad Request"])

    t = threading.Thread(target=answer_garbage)
    t.start()
    h = check(address, timeout=5.0)
    t.join()
    assert not h.ok
    assert "not as an omnireduce aggregator" in h.message


def test_curve_needs_the_key(tmp_path):
    public, secret = zmq.curve_keypair()
    with omnireduce.Aggregator(curve_secret_key=secret.decode()) as agg:
        assert check(agg.address, timeout=5.0, curve_server_key=public.decode()).ok
        h = check(agg.address, timeout=0.5)
        assert not h.ok and "CURVE" in h.message
        key_file = tmp_path / "curve"
        key_file.write_bytes(secret + b"\n")
        assert agg_main(["--check", agg.address, "--curve-secret-key-file", str(key_file)]) == 0


def test_cli_exit_codes_and_one_line(capsys):
    with omnireduce.Aggregator() as agg:
        assert agg_main(["--check", agg.address]) == 0
        out = capsys.readouterr()
        assert out.out.count("\n") == 1 and "healthy" in out.out and out.err == ""
    address = f"tcp://127.0.0.1:{_free_port()}"
    assert agg_main(["--check", address, "--check-timeout", "1"]) == 1
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and "cannot connect" in out.err and out.out == ""
    assert agg_main(["--check", "http://example.invalid/"]) == 1
    assert "not an address" in capsys.readouterr().err


def test_check_as_a_command_against_a_real_omnireduce_agg_process():
    """What a container's HEALTHCHECK or a Kubernetes exec probe runs, against the real CLI."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    agg = subprocess.Popen([sys.executable, "-m", "omnireduce.aggregator.cli", "--listen", address,
                            "--log-interval", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert agg.stdout is not None
        assert agg.stdout.readline().startswith("omnireduce-agg listening on")
        probe = subprocess.run([sys.executable, "-m", "omnireduce.aggregator.cli", "--check", address],
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode == 0, probe.stderr
        assert "healthy" in probe.stdout
    finally:
        agg.terminate()
        assert agg.wait(timeout=30) == 0  # SIGTERM is a clean stop
    probe = subprocess.run([sys.executable, "-m", "omnireduce.aggregator.cli", "--check", address,
                            "--check-timeout", "1"], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 1 and "cannot connect" in probe.stderr
