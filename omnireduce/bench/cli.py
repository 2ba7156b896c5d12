"""The ``omnireduce-bench`` command: arguments, the sweep, the table, the JSON.

Run under a launcher, one process per rank (torchrun, mpiexec, srun); rank 0 prints. Sizes in bytes
as NCCL's tests take them (``-b`` smallest, ``-e`` largest, ``-f`` the factor between; ``K``, ``M``, ``G``:
powers of 1024), densities (``-d``, fractions of the blocks non-zero on each rank) and placements
(``--placement``) make the cases; every case is a row (:mod:`omnireduce.bench.cases`). ``--json``
writes the header and every row. Exit status 1 when ``--check`` finds a result that disagrees.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.bench import about, cases, inputs, table
from omnireduce.bench.launch import barrier, start

log = logging.getLogger("omnireduce.bench")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def size_bytes(text: str) -> int:
    """``16M`` -> 16 MiB in bytes (K, M, G: powers of 1024; a plain number: bytes)."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def sizes(smallest: int, largest: int, factor: float) -> list[int]:
    """``smallest``, times ``factor`` while at most ``largest`` (bytes)."""
    if smallest <= 0 or largest < smallest or factor <= 1:
        raise ValueError(f"sizes: need 0 < -b ({smallest}) <= -e ({largest}) and -f > 1 ({factor})")
    out, s = [], float(smallest)
    while s <= largest * (1 + 1e-9):
        out.append(int(s))
        s *= factor
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="omnireduce-bench", description=__doc__.splitlines()[0])
    p.add_argument("-b", "--minbytes", type=size_bytes, default=size_bytes("1M"), help="smallest tensor (1M)")
    p.add_argument("-e", "--maxbytes", type=size_bytes, default=size_bytes("16M"), help="largest tensor (16M)")
    p.add_argument("-f", "--stepfactor", type=float, default=4.0, help="factor between sizes (4)")
    p.add_argument("-d", "--densities", type=lambda s: [float(v) for v in s.split(",") if v],
                   default=[0.001, 0.01, 0.1, 1.0], help="fractions of blocks non-zero per rank (0.001,0.01,0.1,1)")
    p.add_argument("--placement", type=lambda s: s.split(","), default=["random"],
                   help="random (each rank its own blocks), overlap (the same blocks on every rank), or both")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("-o", "--op", choices=["sum", "avg"], default="sum")
    p.add_argument("-n", "--iters", type=int, default=10, help="timed repeats per case (10)")
    p.add_argument("-w", "--warmup_iters", type=int, default=3, help="untimed repeats first (3)")
    p.add_argument("-c", "--check", action="store_true", help="compare every result with the dense all-reduce's")
    p.add_argument("--vs-hook", action="store_true",
                   help="also the DDP hook's collective engine on the same tensor (op avg, as DDP averages)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--emulate-hosts", action="store_true",
                   help="NCCL: every rank on cuda:0, each claiming a host of its own (one GPU, NCCL's sockets)")
    p.add_argument("--block", type=int, default=256, help="elements per block of the inputs (256)")
    p.add_argument("--timeout", type=float, default=300.0, help="the process group's timeout, seconds")
    p.add_argument("--json", type=Path, default=None, help="write the header and the rows here (rank 0)")
    args = p.parse_args(argv)
    bad = [pl for pl in args.placement if pl not in inputs.PLACEMENTS]
    if bad:
        p.error(f"--placement: {', '.join(bad)}; choose from {', '.join(inputs.PLACEMENTS)}")
    if any(not 0 <= d <= 1 for d in args.densities):
        p.error("-d: densities are fractions between 0 and 1")
    if args.vs_hook:
        args.op = "avg"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(1)
    backend, device = start(args.backend, args.timeout, emulate_hosts=args.emulate_hosts)
    import omnireduce.distributed as odist

    try:
        status = _run(args, argv, backend, device)
    finally:
        odist.shutdown()
    barrier(device)  # (no rank tears its connections down while another still reads from them)
    dist.destroy_process_group()
    return status


def _run(args: argparse.Namespace, argv: list[str], backend: str, device: torch.device) -> int:
    me = dist.get_rank()
    head = about.header(backend, device, argv)
    dtype = DTYPES[args.dtype]
    engine_group, agg_group = cases.groups(device)
    hook = None
    if args.vs_hook:
        from omnireduce.bench.hook import HookBench

        hook = HookBench(device)
    setup = cases.Setup(device, args.op == "avg", engine_group, agg_group, hook, args.warmup_iters, args.iters,
                        args.block)
    rows: list[dict[str, Any]] = []
    plan = [(n, d, pl) for n in sizes(args.minbytes, args.maxbytes, args.stepfactor) for d in args.densities
            for pl in args.placement]
    names: list[str] | None = None
    for nbytes, density, placement in plan:
        row = cases.run_case(setup, max(1, nbytes // dtype.itemsize), density, placement, dtype, args.check)
        rows.append(row)
        if me == 0:
            if names is None:
                names = table.methods(rows)
                print("\n".join(about.lines(head) + table.heading(rows)), flush=True)
            print(table.line(row, names), flush=True)
    wrong = sum(v for r in rows for k, v in r.items() if k.endswith("_wrong"))
    if me == 0:
        print("\n".join(table.notes(rows)) + (f"\n# check: {'every result agrees' if not wrong else f'{wrong} wrong'}"
                                               if args.check else ""), flush=True)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"header": head, "rows": rows}, indent=1) + "\n")
    return 1 if wrong else 0
