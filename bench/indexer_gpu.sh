#!/usr/bin/env bash
# The indexer and DoSA measurements of the H200 tables, in one run from the repository root:
#
#     OUT=out bash bench/indexer_gpu.sh [step ...]
#
# Steps (default: all, in this order): tests, prefill, mosaic, causal, decode,
# decode-batch, dosa, dosa-causal, dosa-decode. Also by name: mosaic-decode,
# mosaic-causal, mosaic-batch (the opt-in Mosaic scorer on the decode, causal and
# serving-batch presets, dense and paged), decode-batch-paged. Each step
# has a time limit (seconds, STEP_LIMIT, default 300; TESTS_LIMIT, default 900, for the
# tests) and writes its log and JSON under $OUT; a step that fails or runs out of time
# does not stop the others. Every bench row is checked against the reference or `base`
# before it is timed.
set -uo pipefail
OUT=${OUT:-out}
PY=${PYTHON:-python3}
LIMIT=${STEP_LIMIT:-300}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
status=0
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests prefill mosaic causal decode decode-batch dosa dosa-causal dosa-decode)

run() {  # run NAME CMD...: log to $OUT/NAME.log
  local name=$1
  shift
  echo "+ $*" | tee "$OUT/$name.log"
  timeout "$LIMIT" "$@" >>"$OUT/$name.log" 2>&1 || { echo "$name: exit $?" | tee -a "$OUT/$name.log"; status=1; }
}

for s in "${steps[@]}"; do
  case $s in
    # the whole gpu marker takes over 330 s on an H200 (run 46): its own limit
    tests) LIMIT=${TESTS_LIMIT:-900} run tests "$PY" -m pytest -q -p no:cacheprovider -rf --tb=short -m gpu tests ;;
    prefill) run prefill "$PY" bench/run.py --backend pallas-gpu --preset prefill-chunk \
      --method xla base full --json "$OUT/prefill.json" --quiet ;;
    mosaic) run mosaic "$PY" bench/run.py --backend pallas-gpu --preset prefill-chunk \
      --method base --implementation mosaic --json "$OUT/mosaic.json" --quiet ;;
    mosaic-decode) run mosaic-decode "$PY" bench/run.py --backend pallas-gpu --preset decode \
      --method base --implementation mosaic --json "$OUT/mosaic_decode.json" --quiet ;;
    mosaic-causal) run mosaic-causal "$PY" bench/run.py --backend pallas-gpu --preset causal-prefill \
      --method base --implementation mosaic --json "$OUT/mosaic_causal.json" --quiet ;;
    causal) run causal "$PY" bench/run.py --backend pallas-gpu --preset causal-prefill \
      --method xla base full --json "$OUT/causal.json" --quiet ;;
    decode) run decode "$PY" bench/run.py --backend pallas-gpu --preset decode \
      --method xla base full --device-time --json "$OUT/decode.json" --quiet ;;
    mosaic-batch) run mosaic-batch "$PY" bench/run.py --backend pallas-gpu --preset decode-batch \
      --method base --implementation mosaic --device-time --json "$OUT/mosaic_batch.json" --quiet
      run mosaic-batch-paged "$PY" bench/run.py --backend pallas-gpu --preset decode-batch-paged \
      --method base --implementation mosaic --device-time --json "$OUT/mosaic_batch_paged.json" --quiet ;;
    decode-batch-paged) run decode-batch-paged "$PY" bench/run.py --backend pallas-gpu \
      --preset decode-batch-paged --method xla base --device-time \
      --json "$OUT/decode_batch_paged.json" --quiet ;;
    decode-batch) run decode-batch "$PY" bench/run.py --backend pallas-gpu --preset decode-batch \
      --method xla base --device-time --json "$OUT/decode_batch.json" --quiet ;;
    dosa) run dosa "$PY" -m bench.dosa --prefill --shapes 8192x32768 8192x65536 8192x131072 \
      --json "$OUT/dosa.json" ;;
    dosa-causal) run dosa-causal "$PY" -m bench.dosa --prefill --shapes 65536x65536 \
      --methods base full dosa --variants --json "$OUT/dosa_causal.json" ;;
    dosa-decode) run dosa-decode "$PY" -m bench.dosa --decode --page-size 64 --device-time \
      --json "$OUT/dosa_decode.json" ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
