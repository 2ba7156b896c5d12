#!/bin/bash
# alternating rounds: old tree (a599527: the engine before its rebuild) and main, same commands
for i in 1 2; do
  for t in old new; do
    if [ $t = old ]; then R=/tmp/oldtree; else R=/work/main; fi
    (cd $R && timeout 900 .venv/bin/python scripts/bench_train.py --models mlp,recsys --hooks allreduce,omnireduce \
       --nets loopback --workers 4 --steps 40 --warmup 20 --json /tmp/b53/train_${t}_$i.json > /tmp/b53/train_${t}_$i.log 2>&1)
    echo "train $t $i rc=$? $(date +%T)" >> /tmp/b53/progress
    (cd $R && timeout 600 .venv/bin/python scripts/bench_allreduce.py --loopback --workers 4 --size-mib 8 \
       --densities 1.0,0.1,0.01 --methods omnireduce,collective,gloo --warmup 2 --iters 9 \
       --json /tmp/b53/micro_${t}_$i.json > /tmp/b53/micro_${t}_$i.log 2>&1)
    echo "micro $t $i rc=$? $(date +%T)" >> /tmp/b53/progress
  done
done
echo done >> /tmp/b53/progress
