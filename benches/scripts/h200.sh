#!/usr/bin/env bash
# tidepool's GPU evidence in one go, run from the repository root on the GPU
# machine after `bash benches/scripts/stage-gpu.sh` staged .gpu/ on the build
# machine (see docs/gpu.md). Writes at most 8 summary files into $OUT.
#   bash benches/scripts/h200.sh evidence   # = tests replay soak memcheck
#   bash benches/scripts/h200.sh benches    # criterion benches, quick mode
#   bash benches/scripts/h200.sh tests replay soak   # any list of parts
# (where one command may run only so long, run the parts in separate commands.)
set -u
OUT=${OUT:-/tmp/tidepool-out}
mkdir -p "$OUT"
export TIDEPOOL_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
parts=${*:-evidence}
case " $parts " in *" evidence "*) parts="tests replay soak memcheck" ;; esac
has() { case " $parts " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u +%FT%TZ >> "$OUT/gpu.txt"
if has tests; then
  echo "== tests"
  timeout 240 bash .gpu/run.sh tests > "$OUT/tests.log" 2>&1
  echo "tests exit $?" | tee -a "$OUT/gpu.txt"
  grep -E "^=== |^test result|FAILED|panicked" "$OUT/tests.log" | tail -80
fi
if has replay; then
  echo "== replay"
  timeout 150 .gpu/bin/tidepool-replay --backend cuda --compare --passes 2 --json \
    --plot "$OUT/replay.svg" benches/traces/gpt2-fixed.csv.gz benches/traces/gpt2-varlen.csv.gz \
    benches/traces/pipeline.csv.gz benches/traces/random-longlived.csv.gz \
    > "$OUT/replay.jsonl" 2> "$OUT/replay.err"
  echo "replay exit $?" | tee -a "$OUT/gpu.txt"
  cat "$OUT/replay.jsonl"; tail -3 "$OUT/replay.err"
fi
if has soak; then
  echo "== soak"
  timeout 170 .gpu/bin/tidepool-soak --backend cuda --ops 1000000 --threads 4 --streams 8 \
    --time-limit-s 150 --quiet --out "$OUT/soak.json" > /dev/null 2>> "$OUT/soak.err"
  echo "soak exit $?" | tee -a "$OUT/gpu.txt"; cat "$OUT/soak.json"
  echo "== capped soak (2 GiB pool cap)"
  timeout 170 .gpu/bin/tidepool-soak --backend cuda --ops 1000000 --threads 4 --streams 8 \
    --max-pool 2G --time-limit-s 150 --quiet --out /tmp/soak-capped.json > /dev/null 2>> "$OUT/soak.err"
  echo "capped soak exit $?" | tee -a "$OUT/gpu.txt"; cat /tmp/soak-capped.json >> "$OUT/soak.json"
  cat /tmp/soak-capped.json
fi
if has memcheck; then
  echo "== memcheck"
  timeout 150 compute-sanitizer --tool memcheck --leak-check full \
    .gpu/bin/tidepool-soak --backend cuda --ops 20000 --threads 4 --streams 8 \
    --max-pool 512M --max-size 16M --trim-every 1000 --sync-every 2000 --release-threshold 64M \
    --quiet --out "$OUT/memcheck.json" > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?" | tee -a "$OUT/gpu.txt"; tail -6 "$OUT/memcheck.log"; cat "$OUT/memcheck.json"
fi
if has benches; then
  TIDEPOOL_BENCH_QUICK=1 TIDEPOOL_BENCH_SUMMARY="$OUT/bench.jsonl" timeout 560 bash .gpu/run.sh benches > "$OUT/bench.log" 2>&1
  echo "benches exit $?" | tee -a "$OUT/gpu.txt"
  grep -E "^=== |skipped|panicked|error" "$OUT/bench.log" | tail -30; wc -l "$OUT/bench.jsonl"
fi
