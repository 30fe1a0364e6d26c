#!/usr/bin/env bash
# GPU run of the cudarc adapter (tidepool::cudarc), for a machine with a
# CUDA device and no Rust toolchain. Run from the repository root:
#
#   BIN=<folder of staged binaries> OUT=<output folder> bash allocator/tests/gpu/cudarc.sh
#
# BIN must hold, built on the CPU machine with --release and stripped:
#   cudarc_gpu, cudarc_untracked      (cargo test --release --no-run -p tidepool --test <name>)
#   cudarc_gpu-broken, cudarc_untracked-broken
#                                     the same two, built with PoolBuffer's drop stripped of
#                                     its event wait (device_ptr_mut) and of its record_use
#                                     loop: their cross-stream tests must FAIL
#   cudarc_port                       (cargo build --release -p tidepool --example cudarc_port)
#   cudarc_bench                      (cargo bench --no-run -p tidepool-benches --bench cudarc)
# Writes one summary file, $OUT/cudarc.txt, and the bench's JSON lines,
# $OUT/cudarc-bench.jsonl.
set -u
: "${BIN:?set BIN to the folder of staged binaries}"
: "${OUT:?set OUT to the output folder}"
BIN=$(cd "$BIN" && pwd)
mkdir -p "$OUT"
log="$OUT/cudarc.txt"
: > "$log"
export TIDEPOOL_REQUIRE_GPU=1
# cuBLAS and NVRTC for cudarc's loader: appended after the driver's own
# directory, and never the toolkit's `stubs` directories (their stub
# libcuda.so fails cuInit with CUDA_ERROR_STUB_LIBRARY).
extra=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib \
  /usr/lib/python3*/site-packages/nvidia /usr/local/lib/python3*/dist-packages/nvidia \
  /usr/local/lib/python3*/site-packages/nvidia \
  -path '*stubs*' -prune -o \( -name 'libcublas.so*' -o -name 'libnvrtc.so*' \) -printf '%h\n' \
  2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}${extra%:}"
status=0

step() { # name, expected (pass | fail:<text the failure must print>), timeout seconds, command...
  local name=$1 expect=$2 limit=$3; shift 3
  local part="$OUT/.cudarc-step"
  echo "=== $name: $*" >> "$log"
  ( cd allocator && timeout "$limit" "$@" ) > "$part" 2>&1
  local rc=$?
  cat "$part" >> "$log"
  local verdict=ok
  case "$expect" in
    pass) [ "$rc" -eq 0 ] || verdict=UNEXPECTED ;;
    # A mutant must fail, and for the reason the test checks (not, say,
    # for want of a driver).
    fail:*) { [ "$rc" -ne 0 ] && grep -q -- "${expect#fail:}" "$part"; } || verdict=UNEXPECTED ;;
  esac
  [ "$verdict" = ok ] || status=1
  rm -f "$part"
  printf '=== %s: rc=%d (expected %s: %s)\n\n' "$name" "$rc" "${expect%%:*}" "$verdict" >> "$log"
  printf '%-22s rc=%-4d expected %-4s %s\n' "$name" "$rc" "${expect%%:*}" "$verdict" >> "$OUT/.cudarc-steps"
}

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo
} >> "$log"
: > "$OUT/.cudarc-steps"

step cudarc_gpu             pass 300 "$BIN/cudarc_gpu" --test-threads=4
step cudarc_untracked       pass 120 "$BIN/cudarc_untracked"
step mutant_tracked         "fail:overwritten by A" 120 "$BIN/cudarc_gpu-broken" drop_waits_for_tracked_reads_on_another_stream
step mutant_untracked       "fail:overwritten by A" 120 "$BIN/cudarc_untracked-broken" drop_waits_for_declared_use_with_tracking_off
step example_cudarc_port    pass 120 "$BIN/cudarc_port"
step bench_cudarc           pass 300 env TIDEPOOL_BENCH_SUMMARY="$OUT/cudarc-bench.jsonl" \
  "$BIN/cudarc_bench" --bench --warm-up-time 1 --measurement-time 2 --noplot

{
  echo "=== summary"
  cat "$OUT/.cudarc-steps"
} >> "$log"
rm -f "$OUT/.cudarc-steps"
exit $status
