#!/usr/bin/env bash
# On an offline GPU host: install carried wheels and put the offline models in hqlab's cache, from parts that
# earlier calls copied into $PARTS (split GGUF files q05.NN / q15.NN and a whl/ folder). hqlab.models verifies
# each reassembled GGUF's sha256 against its pin and converts it once, exactly as on a connected machine.
# Usage: source benchmarks/gpu_setup.sh   (sets PYTHONPATH and HQLAB_CACHE for the commands that follow)
set -e
PARTS=${PARTS:-/tmp/hq}
export HQLAB_CACHE=${HQLAB_CACHE:-/tmp/hqcache}
mkdir -p "$HQLAB_CACHE/gguf" /tmp/site
if [ -d "$PARTS/whl" ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$PARTS"/whl/*.whl && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD
# hqlab's kernels are imported as hqlab_kernels (pyproject maps the folder); without an install, link it
[ -e /tmp/site/hqlab_kernels ] || ln -s "$PWD/kernels" /tmp/site/hqlab_kernels
for pair in "q05:qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" "q15:qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"; do
  prefix=${pair%%:*}; file=${pair#*:}
  if ls "$PARTS/$prefix".* >/dev/null 2>&1 && [ ! -f "$HQLAB_CACHE/gguf/$file" ]; then
    cat "$PARTS/$prefix".* > "$HQLAB_CACHE/gguf/$file"
  fi
done
python3 - <<'PY'
from hqlab import models
for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
    try:
        print(name, "->", models.prepare(name))
    except models.ModelError as e:
        print(name, "not available:", str(e)[:200])
PY
set +e
