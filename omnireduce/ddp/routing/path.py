"""What a bucket's path choice picks among: a way, flat or through the hierarchy, by name.

A :class:`Path` is one of the ways of :class:`omnireduce.engines.ways.Way` (the aggregators
``"aggregators"``, the collective engine ``"collective"``, the dense all-reduce ``"dense"``, and any
engine added there), the same way through the hierarchy (its shards crossing the nodes that way:
``"hier:"`` and its name), or, for a compressed bucket, the whole bucket uncompressed through the
dense all-reduce (``"uncompressed"``, flat or ``"hier:uncompressed"``). The members are made from
:class:`~omnireduce.engines.ways.Way`, so a new way has its paths here with nothing to add. A path is
a ``str`` (its name is what ``stats()`` reports and what its timings are keyed by).

:class:`Span` says where the decided buckets go when the hierarchy runs beside the flat ways and
the step check chooses between them.
"""

from __future__ import annotations

from omnireduce.engines.ways import Way
from omnireduce.names import StrEnum

_HIER = "hier:"


class Path(StrEnum):
    """A way a bucket may take (see the module). Look one up by value: ``Path(Way.DENSE)``,
    ``Path.of(way, hierarchical=True)``."""

    _ignore_ = ["each"]
    UNCOMPRESSED = "uncompressed"
    HIER_UNCOMPRESSED = _HIER + "uncompressed"
    for each in Way:  # (the ways' paths, flat and through the hierarchy)
        vars()[each.name] = each.value
        vars()[f"HIER_{each.name}"] = _HIER + each.value

    @classmethod
    def of(cls, way: str, hierarchical: bool = False) -> Path:
        """The path of ``way`` (a :class:`Way` or ``"uncompressed"``), flat or through the hierarchy."""
        return cls(_HIER + way if hierarchical else way)

    @property
    def hierarchical(self) -> bool:
        """Whether it goes through the hierarchy."""
        return self.value.startswith(_HIER)

    @property
    def flat(self) -> Path:
        """The same way, flat (a flat path: itself); through the hierarchy it is how the shards cross."""
        return Path(self.value.removeprefix(_HIER))

    @property
    def way(self) -> Way:
        """The reducer's way: how the tensor (through the hierarchy: its shards) crosses (uncompressed: dense)."""
        flat = self.flat
        return Way.DENSE if flat is Path.UNCOMPRESSED else Way(flat.value)

    @property
    def whole(self) -> bool:
        """A compressed bucket sent whole, uncompressed."""
        return self.flat is Path.UNCOMPRESSED

    def through_hierarchy(self) -> Path:
        """The same way through the hierarchy."""
        return self if self.hierarchical else Path(_HIER + self.value)


DENSE = Path(Way.DENSE)


class Span(StrEnum):
    """Where the decided buckets go where the hierarchy runs beside the flat ways."""

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"
