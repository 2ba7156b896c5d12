"""Enums whose members are their names as strings, on every Python the package supports (3.10 on).

``enum.StrEnum`` came with Python 3.11. :class:`StrEnum` here behaves the same where it matters to
this package: a member is a ``str`` equal to its value, and ``str()``, ``format()`` and f-strings
give the value (``str(Way.DENSE) == "dense"``), never ``"Way.DENSE"``.
"""

from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """A ``str`` enum whose members print as their values (Python 3.11's ``enum.StrEnum``, for 3.10)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
