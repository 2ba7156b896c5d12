"""What the benchmarks in scripts/ share, as an importable package.

* :mod:`~omnireduce.bench.network`: where the ranks and aggregators run, this machine's loopback or
  an emulated network, and stopping them on the way out.
* :mod:`~omnireduce.bench.netem`: the emulated network itself (network namespaces on a bridge,
  links shaped with tbf).
* :mod:`~omnireduce.bench.mpi`: starting ranks with ``mpiexec``, on loopback or into the namespaces.
* :mod:`~omnireduce.bench.collectives`: the all-reduce methods of bench_allreduce.py, one table
  from name to setup, step and wire floor.
* :mod:`~omnireduce.bench.hooks`: the DDP communication hooks of bench_train.py, one table from
  name to registration and bytes per step.
* :mod:`~omnireduce.bench.traffic`: the bytes each scheme moves (ring, PowerSGD, omnireduce per link).
* :mod:`~omnireduce.bench.tables` and :mod:`~omnireduce.bench.plots`: the output.
* :mod:`~omnireduce.bench.machine`: the machine description recorded with the results.

Importing the package imports none of them; torch, matplotlib and mpi4py are only imported inside
the functions that need them.
"""
