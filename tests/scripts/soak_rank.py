"""One rank of the soak test: N reductions of random sizes, dtypes and densities, each checked
against the float64 reference computed from every rank's input. Prints a JSON summary."""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omnireduce
from tests.harness import Case, assert_matches, make_input, to_numpy

address, job, rank, world, count, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5]), int(sys.argv[6])
rng = np.random.default_rng(seed)  # the same sequence of cases on every rank
cases = [Case(int(rng.integers(0, 300_000)), dtype=str(rng.choice(["float32", "float16", "bfloat16"])),
              density=float(rng.choice([0.0, 0.001, 0.01, 0.1, 0.5, 1.0])), seed=seed * 100_000 + i,
              placement=str(rng.choice(["random", "overlap"]))) for i in range(count)]
failures: list[str] = []


def check(window: list) -> None:
    for c, t, f in window:
        f.result(120)
        try:
            assert_matches(c, world, to_numpy(t))
        except AssertionError as e:
            failures.append(str(e)[:300])
    window.clear()


with omnireduce.Worker([address], rank=rank, world_size=world, job=job, timeout=60) as w:
    window: list = []
    for case in cases:  # several tensors in flight at a time
        x = make_input(case, rank)
        window.append((case, x, w.allreduce_async(x)))
        if len(window) == 8:
            check(window)
    check(window)
    stats = w.stats()
print(json.dumps({"rank": rank, "reductions": count, "failures": failures, "tensors": stats["tensors"]}))
