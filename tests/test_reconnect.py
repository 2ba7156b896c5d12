"""A worker's TCP connection to the aggregator drops and comes back (same aggregator instance).

A real TCP proxy sits between one worker and the aggregator; the test cuts its connections while
the worker is idle, sends a tensor while the link is down (zmq queues it), and lets the worker
reconnect. The worker must keep its place in the job (stable routing id + ROUTER_HANDOVER): the
tensor sent during the blip and every later one equal the float64 reference.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np

import omnireduce


class Proxy:
    """Forwards TCP connections from a local port to ``target``; ``cut()`` closes every one of them."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepting = threading.Event()
        self.accepting.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.05)
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self.accepting.is_set():
                client.close()  # refused while the "network" is down
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._stop = True
        self.cut()
        self.listener.close()


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_connection_blip_to_the_same_aggregator_loses_nothing(job: str) -> None:
    rng = np.random.default_rng()
    with omnireduce.Aggregator() as agg:
        port = int(agg.address.rsplit(":", 1)[1])
        proxy = Proxy(port)
        try:
            with omnireduce.Worker([f"tcp://127.0.0.1:{proxy.port}"], rank=0, world_size=2, job=job,
                                   timeout=20) as w0, \
                    omnireduce.Worker([agg.address], rank=1, world_size=2, job=job, timeout=20) as w1:

                def reduce_both(n: int) -> None:
                    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
                    xs[0][: n // 2] = 0.0  # some all-zero blocks on one rank
                    want = xs[0].astype(np.float64) + xs[1]
                    futs = [w.allreduce_async(x.copy()) for w, x in ((w0, xs[0]), (w1, xs[1]))]
                    for f in futs:
                        np.testing.assert_allclose(f.result(30), want, rtol=1e-6, atol=1e-6)

                reduce_both(70_001)
                link = w0._io._links[0]
                proxy.accepting.clear()
                proxy.cut()
                _wait(lambda: link.dropped, 10, "the worker to notice the dropped connection")
                xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(2)]
                f0 = w0.allreduce_async(xs[0].copy())  # queued while the link is down
                f1 = w1.allreduce_async(xs[1].copy())
                time.sleep(0.3)
                proxy.accepting.set()
                want = xs[0].astype(np.float64) + xs[1]
                for f in (f0, f1):
                    np.testing.assert_allclose(f.result(30), want, rtol=1e-6, atol=1e-6)
                _wait(lambda: not link.dropped, 10, "the worker's HELLO after the reconnect")
                for n in (1, 256 * 3 + 5, 200_000):
                    reduce_both(n)
                assert w0.stats()["tensors"] == w1.stats()["tensors"] == 5
        finally:
            proxy.close()
