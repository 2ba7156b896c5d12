"""Exceptions raised by omnireduce.

Every error names what went wrong and where: the aggregator address, the job, the tensor sequence
number, and (for protocol rounds) the slot and round, so that a failure on a cluster can be traced
without a debugger. All of them derive from :class:`OmniReduceError`.
"""

from __future__ import annotations


class OmniReduceError(RuntimeError):
    """Base class of every error omnireduce raises.

    ``cause``: for an error about a tensor the aggregator had aborted before (a rank that comes
    late), the name of the wire's error code it was aborted with (e.g. ``"MISMATCH"``); else None.
    """

    cause: str | None = None


class OmniReduceTimeout(OmniReduceError, TimeoutError):
    """A deadline passed: the aggregator did not answer, or some ranks did not contribute in time."""


class OmniReduceMismatchError(OmniReduceError, ValueError):
    """Ranks of one job disagreed about a tensor (element count, dtype, block size, ...) or the job."""


class OmniReduceRefused(OmniReduceError, PermissionError):
    """The aggregator refused this worker (wrong token, rank taken, world size differs, ...)."""


class WireError(ValueError):
    """A message could not be decoded: bad magic, version, type, size or field value."""
