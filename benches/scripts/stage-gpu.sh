#!/usr/bin/env bash
# Stage tidepool's binaries for a GPU machine that has no Rust toolchain.
#
# Run on the build machine, from anywhere in the checkout:
#   bash benches/scripts/stage-gpu.sh           # tests, benches, bins and examples
#   bash benches/scripts/stage-gpu.sh --tests   # test binaries only
# It builds release binaries, copies them (stripped) into .gpu/ at the
# repository root (git-ignored) and writes .gpu/run.sh. Copy or ship the
# whole checkout with .gpu/ to the GPU machine, then from the repository
# root there:
#   bash .gpu/run.sh tests [ARGS...]      # every test binary, TIDEPOOL_REQUIRE_GPU=1
#   bash .gpu/run.sh benches [ARGS...]    # every criterion bench binary (--bench)
#   bash .gpu/run.sh bin NAME [ARGS...]   # one binary or example, e.g. tidepool-replay
# Each test and bench runs from its package's directory with
# CARGO_MANIFEST_DIR set to it, as `cargo test` does, so tests find their
# data at run time. The binaries link only glibc; CUDA is loaded at run time.
# See docs/gpu.md.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
mode=${1:-all}
case "$mode" in all|--tests) ;; *) echo "usage: $0 [--tests]" >&2; exit 2 ;; esac
stage=.gpu
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/benches" "$stage/bin" "$stage/lib"
: > "$stage/index.tsv"
# Debug info only makes the copies large; the release profile keeps it.
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_BENCH_DEBUG=0

# stage KIND CARGO-ARGS...: build with cargo, read its JSON messages and copy
# each produced executable of KIND (test, bench or bin) into .gpu/KIND(s).
stage() {
  local kind=$1; shift
  cargo "$@" --message-format=json-render-diagnostics | python3 -c '
import json, os, shutil, sys
kind, root, stage = sys.argv[1], sys.argv[2], ".gpu"
index = open(os.path.join(stage, "index.tsv"), "a")
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") != "compiler-artifact":
        continue
    target = msg["target"]
    if "cdylib" in target["kind"] or "staticlib" in target["kind"]:
        for f in msg.get("filenames", []):
            if f.endswith(".so") or f.endswith(".a"):
                shutil.copy2(f, os.path.join(stage, "lib"))
                print("staged", os.path.join(stage, "lib", os.path.basename(f)))
        continue
    exe = msg.get("executable")
    if not exe:
        continue
    if kind == "test" and not msg["profile"]["test"]:
        continue
    if kind == "bench" and "bench" not in target["kind"]:
        continue
    pkg_dir = os.path.relpath(os.path.dirname(msg["manifest_path"]), root)
    pkg = os.path.basename(pkg_dir) if pkg_dir != "." else "root"
    name = target["name"] if kind == "bin" else pkg + "-" + target["name"]
    folder = {"test": "tests", "bench": "benches", "bin": "bin"}[kind]
    shutil.copy2(exe, os.path.join(stage, folder, name))
    index.write(f"{folder}\t{name}\t{pkg_dir}\n")
    print("staged", os.path.join(stage, folder, name))
' "$kind" "$root"
}

stage test test --workspace --release --no-run
if [ "$mode" = all ]; then
  stage bench bench --workspace --no-run
  stage bin build --workspace --release --bins --examples --lib
else
  # The C-ABI tests link the libraries.
  stage bin build --release -p tidepool-capi --lib
fi
strip "$stage"/tests/* "$stage"/benches/* "$stage"/bin/* 2>/dev/null || true
strip --strip-debug "$stage"/lib/*.a 2>/dev/null || true

cat > "$stage/run.sh" <<'RUN'
#!/usr/bin/env bash
# Run binaries staged by benches/scripts/stage-gpu.sh (see docs/gpu.md).
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
what=${1:-tests}; shift || true
export TIDEPOOL_REQUIRE_GPU=${TIDEPOOL_REQUIRE_GPU:-1}
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The C-ABI tests link the staged libraries (there is no cargo to build them).
[ -f "$here/lib/libtidepool.a" ] && export TIDEPOOL_CAPI_LIB_DIR="$here/lib"
status=0
each() { # each tests|benches [ARGS...]
  local folder=$1; shift
  while IFS=$'\t' read -r dir name pkg_dir; do
    [ "$dir" = "$folder" ] || continue
    echo "=== $name"
    local extra=()
    [ "$folder" = benches ] && extra=(--bench)
    (cd "$root/$pkg_dir" && CARGO_MANIFEST_DIR="$root/$pkg_dir" \
      "$here/$dir/$name" "${extra[@]}" "$@") || status=1
  done < "$here/index.tsv"
}
case "$what" in
  tests|benches) each "$what" "$@" ;;
  bin) name=${1:?usage: run.sh bin NAME [ARGS...]}; shift; "$here/bin/$name" "$@" || status=$? ;;
  *) echo "usage: run.sh tests|benches|bin NAME [ARGS...]" >&2; exit 2 ;;
esac
exit $status
RUN
chmod +x "$stage/run.sh"
du -sh "$stage"
