"""The omnireduce aggregator service (installed as ``omnireduce.aggregator``).

A small numpy + pyzmq process that never imports torch, nor any part of the worker: it runs on
CPU-only hosts and in a slim image. :class:`Aggregator` embeds it in a process (tests, notebooks);
``omnireduce-agg`` runs it as a service. service.py's docstring maps the modules.
"""

from omnireduce.aggregator.limits import AggregatorLimits
from omnireduce.aggregator.service import Aggregator

__all__ = ["Aggregator", "AggregatorLimits"]
