"""Reading environment variables one way for every layer of the package.

Each setting of omnireduce (``OMNIREDUCE_*``) has one reader function, in the module of the layer
that uses it (the worker's in :mod:`omnireduce.config`, the CUDA build's in
:mod:`omnireduce.cuda.build`, the launchers' in :mod:`omnireduce.launch.settings`, ...). They all
read through :func:`env` and :func:`env_number`, so every variable behaves alike: unset and empty
mean the default, and a bad value raises ValueError naming the variable.
"""

from __future__ import annotations

import os


def env(name: str) -> str | None:
    """The value of environment variable ``name``; None if it is unset or empty."""
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def env_number(name: str, kind: type, default: float | int) -> float | int:
    """Environment variable ``name`` converted by ``kind`` (``int`` or ``float``); ``default`` if unset
    or empty; ValueError naming the variable if it does not convert."""
    raw = env(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from None
