#!/usr/bin/env bash
# One H200 session of tidepool's GPU evidence, run from the repository root
# on the GPU machine after `bash ../shared/scripts/stage-gpu.sh` staged .gpu/
# here. Writes at most 8 summary files into $OUT.
#   bash benches/scripts/h200.sh evidence   # tests, replay comparison, soak, memcheck
#   bash benches/scripts/h200.sh benches    # criterion benches, quick mode
set -u
OUT=${OUT:-/tmp/tidepool-out}
mkdir -p "$OUT"
export TIDEPOOL_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
part=${1:-evidence}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u +%FT%TZ >> "$OUT/gpu.txt"
if [ "$part" = evidence ]; then
  echo "== tests"
  timeout 240 bash .gpu/run.sh tests > "$OUT/tests.log" 2>&1
  echo "tests exit $?" | tee -a "$OUT/gpu.txt"
  grep -E "^=== |^test result|FAILED|panicked" "$OUT/tests.log" | tail -80
  echo "== replay"
  timeout 150 .gpu/bin/tidepool-replay --backend cuda --compare --passes 2 --json \
    --plot "$OUT/replay.svg" benches/traces/gpt2-fixed.csv.gz benches/traces/gpt2-varlen.csv.gz \
    > "$OUT/replay.jsonl" 2> "$OUT/replay.err"
  echo "replay exit $?" | tee -a "$OUT/gpu.txt"
  cat "$OUT/replay.jsonl"; tail -3 "$OUT/replay.err"
  echo "== soak"
  timeout 170 .gpu/bin/tidepool-soak --backend cuda --ops 1000000 --threads 4 --streams 8 \
    --time-limit-s 150 --quiet --out "$OUT/soak.json" > /dev/null 2>> "$OUT/replay.err"
  echo "soak exit $?" | tee -a "$OUT/gpu.txt"; cat "$OUT/soak.json"
  echo "== memcheck"
  timeout 150 compute-sanitizer --tool memcheck --leak-check full \
    .gpu/bin/tidepool-soak --backend cuda --ops 20000 --threads 4 --streams 8 \
    --max-pool 512M --max-size 16M --trim-every 1000 --sync-every 2000 --release-threshold 64M \
    --quiet --out "$OUT/memcheck.json" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?" | tee -a "$OUT/gpu.txt"; tail -6 "$OUT/memcheck.log"; cat "$OUT/memcheck.json"
fi
if [ "$part" = benches ]; then
  TIDEPOOL_BENCH_QUICK=1 TIDEPOOL_BENCH_SUMMARY="$OUT/bench.jsonl" timeout 560 bash .gpu/run.sh benches > "$OUT/bench.log" 2>&1
  echo "benches exit $?" | tee -a "$OUT/gpu.txt"
  grep -E "^=== |skipped|panicked|error" "$OUT/bench.log" | tail -30; wc -l "$OUT/bench.jsonl"
fi
