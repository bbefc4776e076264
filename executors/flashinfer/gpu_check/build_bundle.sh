#!/usr/bin/env bash
# Build the offline FlashInfer bundle that run_check.sh installs on a GPU machine with no network.
#
# Runs on a CPU machine with nvcc (CUDA 13.0 here) and network; no GPU is needed. It
#   1. downloads the flashinfer-python wheel and apache-tvm-ffi wheels (one per target Python),
#   2. trims the wheel (drops the CUDA sources of op families the executor never builds),
#   3. compiles ahead of time exactly the modules the executor loads (bundle.py: fa2 batch
#      prefill for bf16 and fp16 at head_dim 128, page, rope) for sm_90a (H100/H200),
#   4. packs the trimmed wheel with the .so files under flashinfer/data/aot/ into $BUNDLE_DIR,
#      beside the tvm-ffi wheels and a manifest.json (versions, modules, hashes, build time),
#   5. installs the bundle with --no-index --no-deps into a scratch target and checks, with JIT
#      disabled, that every module resolves to its prebuilt .so and that each .so loads;
#   6. runs run_check.sh with check.py's preflight short of the GPU (--cpu-preflight): the project's
#      wheels and the bundle installed as on the GPU machine, entry points, every module loaded.
#
# Usage (from anywhere; ~20-30 min of nvcc on 2 cores, nice'd):
#   PYTHON=/work/main/.venv/bin/python executors/flashinfer/gpu_check/build_bundle.sh
# Knobs (environment): PYTHON (any Python 3.10+ with torch importable; a CPU build is fine),
#   FI_VERSION, TVM_FFI_VERSION, TARGET_PYTHONS ("3.12 3.11": the GPU image runs 3.12),
#   FLASHINFER_CUDA_ARCH_LIST (9.0a), CUDA_HOME, BUNDLE_DIR (<repo>/gpu_bundle, git-ignored),
#   WORK_DIR (build scratch, outside the repo), MAX_JOBS (2), NICE (10).
# Nothing is installed into $PYTHON's environment: flashinfer and its small import-time
# dependencies go to $WORK_DIR/deps and $WORK_DIR/tree and are used through PYTHONPATH.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
PYTHON="${PYTHON:-python3}"
FI_VERSION="${FI_VERSION:-0.7.2.post1}"
TVM_FFI_VERSION="${TVM_FFI_VERSION:-0.1.15.post2}"
TARGET_PYTHONS="${TARGET_PYTHONS:-3.12 3.11}"
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
BUNDLE_DIR="${BUNDLE_DIR:-$REPO/gpu_bundle}"
WORK_DIR="${WORK_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/phasesched-flashinfer-bundle}"
export MAX_JOBS="${MAX_JOBS:-2}"
NICE="${NICE:-10}"
START=$(date +%s)

log() { echo "[build_bundle] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)"
"$PYTHON" -c "import torch" 2>/dev/null || die "$PYTHON cannot import torch (set PYTHON)"
NVCC_VERSION="$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\), \(V[0-9.]*\).*/\1 \2/p')"
LOCAL_PY="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
log "flashinfer $FI_VERSION, tvm-ffi $TVM_FFI_VERSION, arch $FLASHINFER_CUDA_ARCH_LIST, nvcc $NVCC_VERSION"
log "work dir $WORK_DIR, bundle $BUNDLE_DIR"
mkdir -p "$WORK_DIR/wheels" "$WORK_DIR/tvm"

# --- 1. wheels ---------------------------------------------------------------------------
pip_download() { "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "$@"; }
pip_download -d "$WORK_DIR/wheels" "flashinfer-python==$FI_VERSION"
for py in $TARGET_PYTHONS $LOCAL_PY; do
    pip_download -d "$WORK_DIR/tvm" --python-version "$py" --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 "apache-tvm-ffi==$TVM_FFI_VERSION"
done
FI_WHEEL="$WORK_DIR/wheels/flashinfer_python-$FI_VERSION-py3-none-any.whl"
[ -f "$FI_WHEEL" ] || die "missing $FI_WHEEL"

# Import-time dependencies of flashinfer for the build (not shipped: the GPU image has them).
LOCAL_TAG="cp${LOCAL_PY/./}"
rm -rf "$WORK_DIR/deps"
"$PYTHON" -m pip install -q --target "$WORK_DIR/deps" \
    "$WORK_DIR"/tvm/apache_tvm_ffi-"$TVM_FFI_VERSION"-"$LOCAL_TAG"-*.whl \
    einops tabulate nvidia-ml-py requests ninja "typing-extensions>=4.13"

# --- 2. trim -----------------------------------------------------------------------------
"$PYTHON" "$HERE/bundle.py" trim --wheel "$FI_WHEEL" --tree "$WORK_DIR/tree"

# --- 3. ahead-of-time modules ------------------------------------------------------------
# The pip-assembled toolkit has no libcuda stub and the modules link -lcuda: a soname-only stub
# satisfies the linker; the driver's real libcuda.so.1 is loaded on the GPU machine.
mkdir -p "$WORK_DIR/stub"
echo | gcc -shared -x c - -o "$WORK_DIR/stub/libcuda.so" -Wl,-soname,libcuda.so.1
ln -sf libcuda.so "$WORK_DIR/stub/libcuda.so.1"
log "compiling modules with nvcc (nice -n $NICE, MAX_JOBS=$MAX_JOBS): this is the long step"
AOT_START=$(date +%s)
env FLASHINFER_EXTRA_LDFLAGS="-L$WORK_DIR/stub" FLASHINFER_WORKSPACE_BASE="$WORK_DIR/jit" \
    PATH="$WORK_DIR/deps/bin:$PATH" PYTHONPATH="$WORK_DIR/tree:$WORK_DIR/deps" \
    nice -n "$NICE" "$PYTHON" "$HERE/bundle.py" aot --tree "$WORK_DIR/tree" --report "$WORK_DIR/aot.json"
log "modules compiled in $(( $(date +%s) - AOT_START )) s"

# --- 4. pack -----------------------------------------------------------------------------
mkdir -p "$BUNDLE_DIR"
rm -f "$BUNDLE_DIR"/*.whl "$BUNDLE_DIR/manifest.json"
"$PYTHON" "$HERE/bundle.py" pack --tree "$WORK_DIR/tree" --out "$BUNDLE_DIR/$(basename "$FI_WHEEL")"
for py in $TARGET_PYTHONS; do
    cp "$WORK_DIR"/tvm/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp"${py/./}"-*.whl "$BUNDLE_DIR/"
done
"$PYTHON" "$HERE/bundle.py" manifest --bundle "$BUNDLE_DIR" --aot-report "$WORK_DIR/aot.json" \
    --flashinfer-version "$FI_VERSION" --tvm-ffi-version "$TVM_FFI_VERSION" \
    --nvcc-version "$NVCC_VERSION" --total-seconds "$(( $(date +%s) - START ))"

# --- 5. verify the install the GPU machine will do -----------------------------------------
rm -rf "$WORK_DIR/verify"
"$PYTHON" -m pip install -q --no-index --no-deps --find-links "$BUNDLE_DIR" --find-links "$WORK_DIR/tvm" \
    --target "$WORK_DIR/verify" "flashinfer-python==$FI_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION"
env FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE="$WORK_DIR/verify-cache" \
    LD_LIBRARY_PATH="$WORK_DIR/stub:$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    PYTHONPATH="$WORK_DIR/verify:$WORK_DIR/deps" \
    "$PYTHON" "$HERE/bundle.py" verify --site "$WORK_DIR/verify" --load > "$WORK_DIR/verify.json"
log "verified: $(grep -c '"aot": true' "$WORK_DIR/verify.json") modules prebuilt and loadable"

# --- 6. the GPU check's own preflight, on this CPU ---------------------------------------------
# run_check.sh as on the GPU machine (project wheels from this tree, the bundle, a fresh target),
# with check.py's preflight short of the GPU itself: distributions, entry points, every module
# for the check's dtypes and head dims loaded by FlashInfer's loader (the stub stands in for libcuda).
env LD_LIBRARY_PATH="$WORK_DIR/stub:$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    PYTHONPATH="$WORK_DIR/deps" PYTHON="$PYTHON" BUNDLE_DIR="$BUNDLE_DIR" SITE_DIR="$WORK_DIR/preflight-site" \
    CHECK_ARGS="--cpu-preflight" bash "$HERE/run_check.sh" "$WORK_DIR/preflight-out" \
    || die "the GPU check's preflight refuses this bundle (see $WORK_DIR/preflight-out/check.log)"
log "the GPU check's preflight passes on this CPU (all but the GPU)"
log "bundle: $(du -sh "$BUNDLE_DIR" | cut -f1) in $BUNDLE_DIR; total $(( $(date +%s) - START )) s"
