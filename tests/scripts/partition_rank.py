"""One rank of tests/test_partition.py, run inside a network namespace: reduce ``n`` tensors one after
another, check each against the float64 sum, and print one JSON line (each tensor's outcome and
times, and the worker's stats). Stops at the first failure. Argument: a JSON object."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omnireduce
from tests.harness import Case, assert_matches, make_input


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = cfg["rank"], cfg["world_size"]
    w = omnireduce.Worker(cfg["aggregators"], rank=rank, world_size=world, job=cfg["job"], timeout=cfg["timeout"],
                         lanes=64)  # several slots per tensor, on both aggregators
    print("ready", flush=True)
    results = []
    for i in range(cfg["n"]):
        case = Case(200_000, density=0.1, seed=i)
        x = make_input(case, rank)
        t0 = time.time()
        try:
            w.allreduce(x)
            assert_matches(case, world, x)
            results.append(["ok", t0, time.time()])
        except Exception as e:
            results.append(["error", t0, time.time(), type(e).__name__, str(e)])
            break
        time.sleep(0.02)
    stats = w.stats()
    w.close()
    print(json.dumps({"results": results, "stats": stats}), flush=True)


if __name__ == "__main__":
    main()
