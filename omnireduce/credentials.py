"""Secrets both sides read: the shared token and zmq CURVE keys, from the environment or a file.

Workers and aggregators take the same secrets the same way: ``$NAME``, else the contents of the file
named by ``$NAME_FILE`` (so that a secret need not sit in a process's environment). This module is
all the two sides share about it, and imports nothing else of the package: the aggregator reads its
token here without loading any of the worker's configuration.
"""

from __future__ import annotations

import os


def env_secret(name: str) -> str | None:
    """``$NAME``, else the contents of the file ``$NAME_FILE`` (stripped); None if neither is set
    (or both are empty). ValueError naming the variable if the file cannot be read."""
    value = os.environ.get(name) or None
    path = os.environ.get(f"{name}_FILE") or None
    if value is None and path is not None:
        try:
            with open(path) as f:
                value = f.read().strip() or None
        except OSError as e:
            raise ValueError(f"cannot read {name}_FILE={path}: {e}") from None
    return value


def check_curve_key(key: str | None, where: str, kind: str) -> None:
    """A zmq CURVE key is 40 characters of Z85; ValueError naming ``where`` otherwise."""
    if key is not None and len(key) != 40:
        raise ValueError(f"{where} does not hold a 40-character Z85 CURVE {kind} key "
                         "(omnireduce-agg --curve-keygen writes a key pair)")
