"""A worker that reduces one tensor, prints "ready", then never reduces again (to be SIGKILLed)."""

import sys
import time

import numpy as np

import omnireduce

address, job, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
w = omnireduce.Worker([address], rank=rank, world_size=world, job=job, timeout=30)
w.allreduce(np.ones(10_000, np.float32))
print("ready", flush=True)
time.sleep(3600)
