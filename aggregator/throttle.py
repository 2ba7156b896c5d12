"""How often the aggregator answers a connection with an error: a token bucket per connection.

A client that keeps sending bad messages must not make the aggregator spend its time and the
client's bandwidth on answers: each connection gets at most ``rate`` error replies per second, in
bursts of up to ``rate``; the caller drops (and counts) the rest. Errors about a tensor that every
rank of a job must hear are not throttled. The map of buckets is bounded: past 10000 connections it
starts again empty, which at worst lets one more burst through.
"""

from __future__ import annotations

import time

_MAX_BUCKETS = 10000


class TokenBucket:
    """At most ``rate`` events per second, with bursts of up to ``rate``."""

    __slots__ = ("rate", "stamp", "tokens")

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.stamp = rate, rate, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Throttle:
    """One :class:`TokenBucket` of ``rate`` per connection identity."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._buckets: dict[bytes, TokenBucket] = {}

    def allow(self, identity: bytes) -> bool:
        """Whether ``identity`` may be sent one more error reply now."""
        bucket = self._buckets.get(identity)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                self._buckets.clear()
            bucket = self._buckets[identity] = TokenBucket(self.rate)
        return bucket.take()
