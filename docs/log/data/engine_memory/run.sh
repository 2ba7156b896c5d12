#!/bin/bash
# Alternating rounds, before and after, the same commands in each: the tree before is 4a286e9 (main when
# the engine-memory work began), the tree after the one under test; each a checkout with its own .venv.
#   bash run.sh TREE_BEFORE TREE_AFTER [OUT]        then: python ../engine_before_after/summarize.py OUT
set -u
OLD=${1:?the tree before}; NEW=${2:?the tree after}; OUT=${3:-/tmp/engine_memory}
mkdir -p "$OUT"
for i in 1 2; do
  for t in old new; do
    if [ $t = old ]; then R=$OLD; else R=$NEW; fi
    (cd "$R" && timeout 1200 .venv/bin/python scripts/bench_train.py --models mlp,recsys --hooks allreduce,omnireduce \
       --nets loopback --workers 4 --steps 40 --warmup 30 --json "$OUT/train_${t}_$i.json" > "$OUT/train_${t}_$i.log" 2>&1)
    echo "train $t $i rc=$? $(date +%T)" >> "$OUT/progress"
    (cd "$R" && timeout 600 .venv/bin/python scripts/bench_allreduce.py --loopback --workers 4 --size-mib 8 \
       --densities 1.0,0.1,0.01 --methods omnireduce,collective,gloo --warmup 2 --iters 9 \
       --json "$OUT/micro_${t}_$i.json" > "$OUT/micro_${t}_$i.log" 2>&1)
    echo "micro $t $i rc=$? $(date +%T)" >> "$OUT/progress"
    (cd "$R" && timeout 900 .venv/bin/python scripts/bench_memory.py --densities 0.002,0.01 \
       --configs ddp,hook,hook-omnireduce,hook-measure-collective --steps 12 --target 10 \
       --out-dir "$OUT/mem_${t}_$i" > "$OUT/mem_${t}_$i.log" 2>&1)
    echo "mem $t $i rc=$? $(date +%T)" >> "$OUT/progress"
  done
done
echo done >> "$OUT/progress"
