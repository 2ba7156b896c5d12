"""What the aggregator reports about itself: counters, a log line per interval, Prometheus metrics.

Counters are plain integers the event loop increments; a log line every ``interval`` seconds in
which messages arrived (an idle aggregator says nothing) gives
jobs, slots in flight, tensors (slots) finished per second, megabytes per second in and out, and the
density of what was summed (union blocks / blocks of the finished slots). With ``metrics_port``, the
same counters are served for Prometheus (``prometheus-client``, installed with the ``metrics``
extra) from a background HTTP thread that only reads them.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("omnireduce.aggregator")

COUNTERS = ("messages_in", "messages_out", "bytes_in", "bytes_out", "slots_completed", "blocks_union",
            "blocks_total", "tensors_aborted", "errors_sent", "errors_suppressed", "send_failures", "replays",
            "deadlines_expired")


class Telemetry:
    """Counters, the periodic log line, and the optional metrics endpoint."""

    def __init__(self, interval: float = 60.0) -> None:
        self.counters: collections.Counter[str] = collections.Counter({k: 0 for k in COUNTERS})
        self.interval = interval
        self._last = time.monotonic()
        self._last_counts = dict(self.counters)

    def count(self, **increments: int) -> None:
        counters = self.counters
        for name, n in increments.items():  # (Counter.update is several times slower, per message)
            counters[name] += n

    def snapshot(self) -> dict[str, int]:
        return dict(self.counters)

    def maybe_log(self, now: float, gauges: Callable[[], dict[str, int]]) -> None:
        """Log the status line if an interval has passed (``gauges`` is only called then)."""
        if self.interval <= 0 or now - self._last < self.interval:
            return
        dt, c, p = now - self._last, self.snapshot(), self._last_counts
        if c["messages_in"] == p["messages_in"]:  # idle: nothing to say, and nothing said
            self._last = now
            return
        gauges_now = gauges()
        blocks = c["blocks_total"] - p["blocks_total"]
        density = (c["blocks_union"] - p["blocks_union"]) / blocks if blocks else 0.0
        log.info("jobs %d, slots in flight %d, %.1f slots/s, in %.1f MB/s, out %.1f MB/s, density %.3f, "
                 "aborted %d, errors %d", gauges_now["jobs"], gauges_now["slots_in_flight"],
                 (c["slots_completed"] - p["slots_completed"]) / dt, (c["bytes_in"] - p["bytes_in"]) / dt / 1e6,
                 (c["bytes_out"] - p["bytes_out"]) / dt / 1e6, density, c["tensors_aborted"] - p["tensors_aborted"],
                 c["errors_sent"] - p["errors_sent"])
        self._last, self._last_counts = now, c

    def serve_metrics(self, port: int, host: str, gauges: Callable[[], dict[str, int]]) -> int:
        """Serve Prometheus metrics on ``host:port`` (0: any free port); returns the port."""
        try:
            from prometheus_client import CollectorRegistry, start_http_server
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        except ImportError as e:
            raise RuntimeError("--metrics-port needs prometheus-client: pip install 'omnireduce[metrics]'") from e
        telemetry = self

        class Collector:
            def collect(self) -> Any:
                for name, value in telemetry.snapshot().items():
                    yield CounterMetricFamily(f"omnireduce_aggregator_{name}", name.replace("_", " "), value=value)
                for name, value in gauges().items():
                    yield GaugeMetricFamily(f"omnireduce_aggregator_{name}", name.replace("_", " "), value=value)

        registry = CollectorRegistry()
        registry.register(Collector())
        server, _thread = start_http_server(port, addr=host, registry=registry)
        return int(server.server_address[1])
