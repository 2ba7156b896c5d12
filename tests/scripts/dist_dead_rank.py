"""One rank of tests/test_distributed.py's dead-rank test: ``python dist_dead_rank.py VICTIM OUT_DIR``.

Every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the test) makes one call of
omnireduce.distributed.all_reduce; the victim then ends its process; the others make a second call
and write what it raised and how long after it began to OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import omnireduce.distributed as odist

victim, out = int(sys.argv[1]), Path(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
odist.all_reduce(torch.ones(100_000))
if rank == victim:
    os._exit(0)
t0 = time.monotonic()
try:
    odist.all_reduce(torch.ones(100_000))
    result = {"error": None}
except Exception as e:
    result = {"error": f"{type(e).__name__}: {e}"}
result["after"] = time.monotonic() - t0
(out / f"rank{rank}.json").write_text(json.dumps(result))
odist.shutdown()
os._exit(0)  # (the group's peer is gone: no teardown that could wait on it)
