#!/usr/bin/env bash
# The offline GPU check of the FlashInfer executor, in one command, on a fresh H100/H200 machine
# with no network (see README.md beside this file for the device tool's exact call).
#
#   bash executors/flashinfer/gpu_check/run_check.sh OUT_DIR
#
# 1. refuses at once, in one line, when the bundle cannot serve this interpreter (no bundle, no
#    apache-tvm-ffi wheel for this Python, Python older than 3.11);
# 2. builds wheels of phasesched, phasesched-torch and phasesched-flashinfer from this working
#    tree (bundle.py project-wheels: standard library only, no network) and installs them with the
#    bundle's flashinfer and tvm-ffi wheels, pip --no-index --no-deps, into a fresh target
#    directory: real distributions, so the policies' and executors' entry points exist exactly as
#    after a pip install; torch and the rest are the image's own;
# 3. runs check.py with only that directory on PYTHONPATH and FLASHINFER_DISABLE_JIT=1 (a kernel
#    that is not prebuilt fails at once, naming the module, instead of compiling for minutes);
#    check.py's preflight refuses in one line if an entry point, an executor or a prebuilt module
#    (each .so is loaded) is missing, before any measurement;
# 4. leaves check.json, profile.csv, pytest.xml and check.log in OUT_DIR.
# A stand-in bundle (bundle.py stand-in: the CPU fake of the kernels) rehearses the same run on a
# CPU; the test suite does that (tests/executors/flashinfer/test_gpu_layout.py).
# Exit status: 0 passed, 1 a section failed, 2 the machine cannot run the check (the reason is
# printed last and stored in check.json), 3 the bundle is missing, does not fit this Python, or
# does not install.
# Knobs (environment): PYTHON (python3), BUNDLE_DIR (<repo>/gpu_bundle), SITE_DIR (scratch
# install target, emptied first), CHECK_TIMEOUT_S (390: hard limit on check.py), CHECK_ARGS
# (extra check.py arguments, e.g. "--sections correctness").
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
OUT_DIR="${1:-${OUT:-$REPO/gpu_check_out}}"
PYTHON="${PYTHON:-python3}"
BUNDLE_DIR="${BUNDLE_DIR:-$REPO/gpu_bundle}"
SITE_DIR="${SITE_DIR:-/tmp/phasesched-flashinfer-site}"
CHECK_TIMEOUT_S="${CHECK_TIMEOUT_S:-390}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/check.log"
: > "$LOG"
say() { echo "[run_check] $*" | tee -a "$LOG"; }
refuse() {  # one line, in the log and in check.json, then exit 3
    say "CANNOT RUN: $*"
    "$PYTHON" -c 'import json, sys; json.dump({"status": "unusable", "error": sys.argv[2]}, open(sys.argv[1], "w"))' \
        "$OUT_DIR/check.json" "$*" 2>/dev/null
    exit 3
}
manifest_field() {
    "$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$BUNDLE_DIR/manifest.json" "$1"
}

[ -f "$BUNDLE_DIR/manifest.json" ] || refuse "no bundle at $BUNDLE_DIR: build it with executors/flashinfer/gpu_check/build_bundle.sh on a CPU machine and carry gpu_bundle (the device tool's carry: [\"gpu_bundle\"])"
PY_TAG="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null)" \
    || refuse "$PYTHON does not run"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || refuse "$PYTHON is Python $PY_TAG; the check needs 3.11 or newer (tomllib builds the project's wheels)"
FI_VERSION="$(manifest_field flashinfer_version)"
TVM_FFI_VERSION="$(manifest_field tvm_ffi_version)"
FI_WHEEL="$(ls "$BUNDLE_DIR"/flashinfer_python-"$FI_VERSION"-*.whl 2>/dev/null | head -n 1)"
[ -n "$FI_WHEEL" ] || refuse "the bundle in $BUNDLE_DIR has no flashinfer_python-$FI_VERSION wheel"
TVM_WHEEL="$(ls "$BUNDLE_DIR"/apache_tvm_ffi-"$TVM_FFI_VERSION"-{cp${PY_TAG/./}-*,py3-none-any}.whl 2>/dev/null | head -n 1)"
[ -n "$TVM_WHEEL" ] || refuse "the bundle has no apache-tvm-ffi $TVM_FFI_VERSION wheel for Python $PY_TAG (cp${PY_TAG/./}); rebuild it with TARGET_PYTHONS including $PY_TAG"
say "$("$PYTHON" --version 2>&1) at $(command -v "$PYTHON"); bundle: flashinfer $FI_VERSION, $(basename "$TVM_WHEEL")"

START=$(date +%s)
WHEELS="$SITE_DIR.wheels"
"$PYTHON" "$HERE/bundle.py" project-wheels --repo "$REPO" --out "$WHEELS" > "$OUT_DIR/install.log" 2>&1 \
    || { cat "$OUT_DIR/install.log" >> "$LOG"; refuse "could not build the project's wheels (see check.log)"; }
rm -rf "$SITE_DIR"
if ! "$PYTHON" -m pip install --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE_DIR" "$FI_WHEEL" "$TVM_WHEEL" "$WHEELS"/*.whl >> "$OUT_DIR/install.log" 2>&1; then
    cat "$OUT_DIR/install.log" >> "$LOG"
    refuse "the bundle and the project's wheels do not install with $("$PYTHON" --version 2>&1) (pip's output is in check.log)"
fi
say "installed flashinfer, tvm-ffi and $(ls "$WHEELS" | tr '\n' ' ')in $(( $(date +%s) - START )) s into $SITE_DIR"

# Only the installed distributions: the repository's sources are not on the path.
export PYTHONPATH="$SITE_DIR${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE_DIR/bin:$PATH"
export PYTHONNOUSERSITE=1
export FLASHINFER_DISABLE_JIT=1
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/phasesched-flashinfer-cache}"
export PYTHONUNBUFFERED=1
cd "$REPO" || exit 3
# shellcheck disable=SC2086  # CHECK_ARGS is a list of words on purpose
timeout --kill-after=15 "$CHECK_TIMEOUT_S" "$PYTHON" "$HERE/check.py" --out "$OUT_DIR" --bundle "$BUNDLE_DIR" \
    --site "$SITE_DIR" --install-log "$OUT_DIR/install.log" --limit-s "$CHECK_TIMEOUT_S" ${CHECK_ARGS:-} 2>&1 \
    | tee -a "$LOG"
STATUS=${PIPESTATUS[0]}
rm -f "$OUT_DIR/install.log"
if [ "$STATUS" -eq 124 ] || [ "$STATUS" -eq 137 ]; then
    say "FAILED: check.py ran past ${CHECK_TIMEOUT_S} s; check.json holds the sections that finished"
    exit 1
fi
say "check.py exited $STATUS; results in $OUT_DIR"
exit "$STATUS"
