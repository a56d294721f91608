#!/usr/bin/env bash
# One GPU session's work for the fusion benchmark and the draft-vocabulary corpora, after the parts are carried
# (see benchmarks/gpu_setup.sh). Runs in the background (setsid) so it may outlast one call; every result and the
# log go to $JOB, which later calls copy into $OUT.
JOB=${JOB:-/tmp/gpujob}
mkdir -p "$JOB"
source benchmarks/gpu_setup.sh > "$JOB/setup.log" 2>&1
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 benchmarks/bench_fusion.py --tag h200 --device cuda --doc-tokens ${DOC_TOKENS:-4000} \
      --new-tokens ${NEW_TOKENS:-192} --out-dir "$JOB" && echo BENCH_DONE
  for m in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
    python3 benchmarks/selfgen_gpu.py --model $m --records ${RECORDS:-1024} --batch-size 256 \
        --max-new-tokens ${SELFGEN_TOKENS:-384} --out "$JOB/selfgen_$m.jsonl" --device cuda \
        --latency-sizes 8192,16384,32768,49152,65536,151936 --latency-out "$JOB/vocab_latency_gpu_$m.json" \
        && echo "SELFGEN_DONE $m"
  done
  echo ALL_DONE
} > "$JOB/log" 2>&1
