"""The omnireduce worker client (installed as ``omnireduce.worker``).

:class:`Worker` reduces numpy arrays and torch tensors in place through the aggregators; one
background I/O thread per worker drives every tensor in flight.
"""

from omnireduce.worker.client import Worker

__all__ = ["Worker"]
