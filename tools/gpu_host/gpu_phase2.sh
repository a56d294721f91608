#!/usr/bin/env bash
# One GPU session's work, started under setsid so it outlasts the call that starts it; every result and the log
# go to $JOB, which later calls copy into $OUT.
#   1. vLLM 0.26 (parts from `benchmarks/vllm_h200.py prepare`, stashed first): the labd suite, 3 repeats, hqlab's
#      lookup vs vLLM's ngram at k=7 and k=15, plus a lookup with a shorter minimum match.
#   2. Once the second parts set has arrived (polars + gguf wheels and the 1.5B GGUF, packed by
#      `benchmarks/pack_parts.py pack ... --out .parts-hf` and stashed into $HF_PARTS while step 1 runs):
#      self-generated corpora for the draft vocabulary (1.5B, then 0.5B), 1024 records each.
#   3. The cost model check on the H200 (benchmarks/bench_costmodel.py: calibrate, replay, predict, measure live
#      with 3 repeats) for the 0.5B and the 1.5B.
set -u
JOB=${JOB:-/tmp/gpujob2}
WORK=/tmp/hqlab-gpu                 # vllm_h200.py's work folder: the 0.5B is converted into $WORK/cache
HF_PARTS=$WORK/parts-hf
HF_PARTS_COUNT=${HF_PARTS_COUNT:-23}
mkdir -p "$JOB"
export PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*"; }
{
  log start
  nvidia-smi --query-gpu=name,driver_version --format=csv
  OUT=$JOB python3 benchmarks/vllm_h200.py run --tag b --repeats 3 --max-new-tokens 256 \
      --config lookup:nmin=6,nmax=12,k=15 --config lookup:nmin=6,nmax=12,k=7 --config lookup:nmin=3,nmax=12,k=15 \
      --config vllm-ngram:nmin=2,nmax=5,k=7 --config vllm-ngram:nmin=2,nmax=5,k=15 > "$JOB/vllm.out" 2>&1
  log "VLLM_DONE rc=$?"

  while [ "$(ls "$HF_PARTS"/part-*.bin 2>/dev/null | wc -l)" -lt "$HF_PARTS_COUNT" ]; do sleep 3; done
  python3 benchmarks/pack_parts.py unpack --parts "$HF_PARTS" --out "$WORK/files-hf" || { log UNPACK_FAILED; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WORK"/files-hf/*.whl || { log INSTALL_FAILED; exit 1; }
  export HQLAB_CACHE=$WORK/cache PYTHONPATH=/tmp/site:$PWD
  mkdir -p "$HQLAB_CACHE/gguf"
  mv "$WORK"/files-hf/*.gguf "$HQLAB_CACHE/gguf/"
  [ -e /tmp/site/hqlab_kernels ] || ln -s "$PWD/kernels" /tmp/site/hqlab_kernels
  log HF_READY

  python3 benchmarks/selfgen_gpu.py --model qwen2.5-coder-1.5b --records 1024 --batch-size 256 \
      --max-new-tokens 384 --out "$JOB/selfgen_qwen2.5-coder-1.5b.jsonl" --device cuda \
      --latency-sizes 8192,16384,32768,65536,151936 --latency-out "$JOB/vocab_latency_gpu_qwen2.5-coder-1.5b.json" \
      > "$JOB/selfgen15.out" 2>&1
  log "SELFGEN15_DONE rc=$?"
  python3 benchmarks/bench_costmodel.py --tag h200 --device cuda --repeats 3 \
      --out "$JOB/costmodel_h200.parquet" > "$JOB/costmodel05.out" 2>&1
  log "COST05_DONE rc=$?"
  python3 benchmarks/selfgen_gpu.py --model qwen2.5-coder-0.5b --records 1024 --batch-size 256 \
      --max-new-tokens 384 --out "$JOB/selfgen_qwen2.5-coder-0.5b.jsonl" --device cuda \
      --latency-sizes 8192,16384,32768,65536,151936 --latency-out "$JOB/vocab_latency_gpu_qwen2.5-coder-0.5b.json" \
      > "$JOB/selfgen05.out" 2>&1
  log "SELFGEN05_DONE rc=$?"
  python3 benchmarks/bench_costmodel.py --tag h200-1.5b --model qwen2.5-coder-1.5b --device cuda --repeats 3 \
      --out "$JOB/costmodel_h200-1.5b.parquet" > "$JOB/costmodel15.out" 2>&1
  log "COST15_DONE rc=$?"
  log ALL_DONE
} >> "$JOB/log" 2>&1
