#!/bin/bash
# alternating rounds: old tree (4a286e9: main at this session's start) and main, same commands
for i in 1 2; do
  for t in old new; do
    if [ $t = old ]; then R=/tmp/headtree; else R=/work/main; fi
    (cd $R && timeout 1200 .venv/bin/python scripts/bench_train.py --models mlp,recsys --hooks allreduce,omnireduce \
       --nets loopback --workers 4 --steps 40 --warmup 30 --json /tmp/b54/train_${t}_$i.json > /tmp/b54/train_${t}_$i.log 2>&1)
    echo "train $t $i rc=$? $(date +%T)" >> /tmp/b54/progress
    (cd $R && timeout 600 .venv/bin/python scripts/bench_allreduce.py --loopback --workers 4 --size-mib 8 \
       --densities 1.0,0.1,0.01 --methods omnireduce,collective,gloo --warmup 2 --iters 9 \
       --json /tmp/b54/micro_${t}_$i.json > /tmp/b54/micro_${t}_$i.log 2>&1)
    echo "micro $t $i rc=$? $(date +%T)" >> /tmp/b54/progress
    (cd $R && timeout 900 .venv/bin/python scripts/bench_memory.py --densities 0.002,0.01 \
       --configs ddp,hook,hook-omnireduce,hook-measure-collective --steps 12 --target 10 \
       --out-dir /tmp/b54/mem_${t}_$i > /tmp/b54/mem_${t}_$i.log 2>&1)
    echo "mem $t $i rc=$? $(date +%T)" >> /tmp/b54/progress
  done
done
echo done >> /tmp/b54/progress
