#!/usr/bin/env bash
# The real model's GPU measurements and GPU tests, in one run from the repository root:
#
#     OUT=out bash bench/model_gpu.sh
#
# Needs jax with CUDA, flax, jaxtyping, tqdm, pytest; no assets and no `gguf`: timings run
# SmolLM2-135M's shapes with random weights (the arithmetic does not depend on the values).
# When a model pack is in $JSPARSE_CACHE/pack (python -m jsparse.assets export-pack), the
# real-weight perplexity and the real-model tests run as well.
set -uo pipefail
OUT=${OUT:-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
LOG=$OUT/model_gpu.log
status=0
step() {
  echo "+ $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG" || status=1
}

step "$PY" -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/models
step "$PY" -m pytest -q -p no:cacheprovider tests/models/test_llama.py
step "$PY" bench/model.py --json "$OUT/model_tp.json" throughput --weights synthetic \
  --context 2048 8192 --repeats 5
step "$PY" bench/model.py --json "$OUT/model_capture.json" capture --weights synthetic --tokens 8192
step "$PY" bench/model.py --query-chunk 2048 --key-chunk 2048 --json "$OUT/model_tp_2048.json" \
  throughput --weights synthetic --context 2048 8192 --repeats 5
if [ -f "${JSPARSE_CACHE:-$HOME/.cache/jsparse}/pack/manifest.json" ]; then
  step "$PY" bench/model.py --json "$OUT/model_ppl.json" perplexity --tokens 512 4096
  step "$PY" -m pytest -q -p no:cacheprovider tests/models/test_real_model.py
fi
exit $status
