#!/usr/bin/env bash
# Packs what bench/trainer/cuda_checks.sh needs on a lent GPU machine whose own torch is not the
# libtorch 2.13 titan-train links: libtorch 2.13's libraries (libtorch_cuda.so cut to sm_90 by
# scripts/strip_fatbins.py), release titan-train (--features nccl) and titan-obs, the nccl_cuda,
# dist_train and gpu_timing test binaries, zstd to unpack them. The device tool carries at most 64 MiB a
# call, so the pack is split into parts in .gpu1, .gpu2, ... (git-ignored through
# .git/info/exclude), one part per call; .gpuN (the last) also holds unpack.sh and zstd.
#
# Then, one device call each, within 30 s of the last (the machine stays warm that long):
#   carry [".gpu1"]: mkdir -p /root/stage && cp .gpu1/part.* /root/stage/
#   carry [".gpu2"]: cp .gpu2/part.* /root/stage/            (and so on)
#   carry [".gpuN"]: bash .gpuN/unpack.sh && BIN=/root/stage/bin LIBTORCH=/root/stage/lib \
#                      WORK=/tmp/cc bash bench/trainer/cuda_checks.sh 2>&1 | tee $OUT/log
#
# Usage: bash scripts/gpu_stage.sh   (takes ~10 min on 2 cores; release builds go to target-rel/)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
lib="$(.venv/bin/python -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
export CARGO_INCREMENTAL=0
rel="${REL_TARGET_DIR:-$root/target-rel}"
CARGO_TARGET_DIR="$rel" cargo build --release --locked -p titan-train --features nccl --bin titan-train
CARGO_TARGET_DIR="$rel" cargo build --release --locked -p titan-obs --bin titan-obs
nccl_test="$(CARGO_TARGET_DIR="$rel" cargo test --release --locked -p titan-train --features nccl \
  --test nccl_cuda --no-run --message-format json 2>/dev/null |
  .venv/bin/python -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "nccl_cuda" and m.get("executable"):
        print(m["executable"])')"
# The end-to-end tests that have a CUDA mode (TITAN_TEST_CUDA=1), debug builds as CI runs them.
tests_bin() {
  cargo test --workspace --locked --test "$1" --no-run --message-format json 2>/dev/null |
    .venv/bin/python -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$1"
}
# tests/'s end-to-end tests (dist_train, gpu_timing among them) are one binary.
e2e_test="$(tests_bin e2e)"
mkdir -p "$stage/lib" "$stage/bin"
for f in libtorch_cpu.so libc10.so libc10_cuda.so libtorch.so libtorch_global_deps.so \
  libtorch_nvshmem.so libgomp.so.1 libshm.so libcaffe2_nvrtc.so; do
  cp "$lib/$f" "$stage/lib/"
done
.venv/bin/python scripts/strip_fatbins.py "$lib/libtorch_cuda.so" "$stage/lib/libtorch_cuda.so"
cp "$rel/release/titan-train" "$rel/release/titan-obs" "$stage/bin/"
cp "$nccl_test" "$stage/bin/nccl_cuda"
cp "$e2e_test" "$stage/bin/e2e"
strip "$stage/bin/"*
(cd "$stage" && tar cf - lib bin | zstd -19 -T0 -q -o pack.tar.zst)
grep -qx '/.gpu\*/' .git/info/exclude 2>/dev/null || echo '/.gpu*/' >> .git/info/exclude
rm -rf .gpu[0-9]*
split -b 57M -d -a 1 "$stage/pack.tar.zst" "$stage/part."
n=0
for part in "$stage"/part.*; do
  n=$((n + 1))
  mkdir -p ".gpu$n"
  mv "$part" ".gpu$n/"
done
last=".gpu$n"
mkdir -p "$last/zt"
cp "$(command -v zstd)" "$last/zt/"
for dep in $(ldd "$(command -v zstd)" | awk '/=> \// {print $3}' | grep -v -E 'libc\.so|ld-linux'); do
  cp "$dep" "$last/zt/"
done
cat > "$last/unpack.sh" <<'UNPACK'
#!/usr/bin/env bash
# Joins the parts in /root/stage (this folder's too) and unpacks lib/ and bin/ there.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p /root/stage
cp "$here"/part.* /root/stage/
cd /root/stage
cat part.* | LD_LIBRARY_PATH="$here/zt" "$here/zt/zstd" -d -q | tar -xf -
rm -f part.*
ls -la lib bin
UNPACK
du -sh .gpu[0-9]*
echo "$n parts: carry .gpu1 ... .gpu$n one call each (see the top of this script)"
