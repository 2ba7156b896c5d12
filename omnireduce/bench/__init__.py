"""``omnireduce-bench``: torch.distributed's all-reduce against omnireduce's, on the user's own cluster.

    torchrun --nproc-per-node 4 -m omnireduce.bench --check          # or: omnireduce-bench under torchrun
    mpiexec -n 8 omnireduce-bench -b 1M -e 256M -f 4 -d 0.001,0.01,0.1,1 --json out.json
    srun -N 2 --ntasks-per-node 4 omnireduce-bench --backend nccl

Like NCCL's ``all_reduce_perf``: it sweeps tensor sizes (``-b``, ``-e``, ``-f``) and densities (``-d``),
and prints one row per case: ``torch.distributed.all_reduce`` against
``omnireduce.distributed.all_reduce`` (the collective engine, and the aggregators where
``OMNIREDUCE_AGGREGATORS`` names them), each with its algorithm and bus bandwidth, in the group's
latency units, the speedup, the bytes sent against the dense ring's, and with ``--check`` whether the
results agree. ``--vs-hook`` times the same tensors through the DDP hook's engine as well.

- :mod:`~omnireduce.bench.cli`: the command (arguments, the run, the output);
- :mod:`~omnireduce.bench.launch`: the process group from torchrun's, MPI's or Slurm's variables;
- :mod:`~omnireduce.bench.inputs`: tensors of a given density and placement;
- :mod:`~omnireduce.bench.timing`: timed runs taking turns repeat by repeat, medians of the slowest rank;
- :mod:`~omnireduce.bench.cases`: one case (a size, a density): the methods timed and checked;
- :mod:`~omnireduce.bench.hook`: the DDP hook's engine on the same tensor;
- :mod:`~omnireduce.bench.about`: the header (device, backend, world, versions);
- :mod:`~omnireduce.bench.table`: the rows as text.
"""
