#!/usr/bin/env bash
# GPU run of the sharing work (peer access and IPC), for a machine with one
# or two CUDA devices and no Rust toolchain. Run from the repository root:
#
#   BIN=<folder of staged binaries> OUT=<output folder> bash allocator/tests/gpu/sharing.sh
#
# BIN must hold, built on the CPU machine with --release:
#   ipc_cuda, peer_cuda, ipc_host   (cargo test --release --no-run -p tidepool --test <name>,
#                                    the executables copied under these names)
#   ipc_ranks, peer                 (cargo build --release --examples -p tidepool,
#                                    target/release/examples/<name>)
# It runs the CUDA IPC tests (2 and 4 processes, misuse), the two-GPU peer
# tests (they print SKIP with one GPU) with NCCL_NVLS_ENABLE=0, both
# examples, and one compute-sanitizer memcheck run of the IPC example, and
# writes one summary file, $OUT/sharing.txt. It creates no multicast objects.
set -u
: "${BIN:?set BIN to the folder of staged binaries}"
: "${OUT:?set OUT to the output folder}"
BIN=$(cd "$BIN" && pwd)
mkdir -p "$OUT"
log="$OUT/sharing.txt"
: > "$log"
export TIDEPOOL_REQUIRE_GPU=1
export NCCL_NVLS_ENABLE=0
export CARGO_MANIFEST_DIR="$PWD/allocator"
status=0

step() { # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" >> "$log"
  local t0=$(date +%s.%N)
  ( cd allocator && timeout "$limit" "$@" ) >> "$log" 2>&1
  local rc=$?
  local t1=$(date +%s.%N)
  printf '=== %s: rc=%d wall=%.1fs\n\n' "$name" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')" >> "$log"
  [ "$rc" -eq 0 ] || status=1
  printf '%-28s rc=%d\n' "$name" "$rc" >> "$OUT/.steps"
}

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>&1 | head -8
  echo
} >> "$log"
: > "$OUT/.steps"

step ipc_host            300 "$BIN/ipc_host" --test-threads=1
step ipc_cuda            300 "$BIN/ipc_cuda" --test-threads=1 --nocapture
step peer_cuda           300 "$BIN/peer_cuda" --test-threads=1 --nocapture
step example_ipc_ranks   120 "$BIN/ipc_ranks" --cuda --ranks 4
step example_ipc_host    120 "$BIN/ipc_ranks" --ranks 4
step example_peer        120 "$BIN/peer"
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step memcheck_ipc_ranks  400 "$SAN" --tool memcheck --target-processes all --error-exitcode 9 \
  "$BIN/ipc_ranks" --cuda --ranks 2

{
  echo "=== summary"
  cat "$OUT/.steps"
  echo "overall: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
} >> "$log"
rm -f "$OUT/.steps"
tail -12 "$log"
exit $status
