#!/usr/bin/env bash
# The offline GPU check of the FlashInfer executor, in one command, on a fresh H100/H200 machine
# with no network (see README.md beside this file for the device tool's exact call).
#
#   bash executors/flashinfer/gpu_check/run_check.sh OUT_DIR
#
# 1. installs the prebuilt bundle (gpu_bundle/, built on a CPU machine by build_bundle.sh) with
#    pip --no-index --no-deps into a scratch target directory; nothing else is installed, and
#    torch must be the image's own CUDA build;
# 2. runs check.py with FLASHINFER_DISABLE_JIT=1 (a kernel that is not prebuilt fails at once,
#    naming the module, instead of compiling for minutes) and the repository's sources on
#    PYTHONPATH;
# 3. leaves check.json, profile.csv, pytest.xml and check.log in OUT_DIR.
# Exit status: 0 passed, 1 a section failed, 2 the machine cannot run the check (the reason is
# printed last and stored in check.json), 3 the bundle is missing or does not install.
# Knobs (environment): PYTHON (python3), BUNDLE_DIR (<repo>/gpu_bundle), SITE_DIR (scratch
# install target), CHECK_TIMEOUT_S (420: hard limit on check.py), CHECK_ARGS (extra check.py
# arguments, e.g. "--sections correctness").
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
OUT_DIR="${1:-${OUT:-$REPO/gpu_check_out}}"
PYTHON="${PYTHON:-python3}"
BUNDLE_DIR="${BUNDLE_DIR:-$REPO/gpu_bundle}"
SITE_DIR="${SITE_DIR:-/tmp/phasesched-flashinfer-site}"
CHECK_TIMEOUT_S="${CHECK_TIMEOUT_S:-420}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/check.log"
: > "$LOG"
say() { echo "[run_check] $*" | tee -a "$LOG"; }

manifest_field() {
    "$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$BUNDLE_DIR/manifest.json" "$1"
}

if [ ! -f "$BUNDLE_DIR/manifest.json" ]; then
    say "FAILED: no bundle at $BUNDLE_DIR: run executors/flashinfer/gpu_check/build_bundle.sh on a CPU machine"
    say "and carry gpu_bundle (the device tool's carry: [\"gpu_bundle\"])"
    exit 3
fi
FI_VERSION="$(manifest_field flashinfer_version)"
TVM_FFI_VERSION="$(manifest_field tvm_ffi_version)"
say "installing flashinfer-python $FI_VERSION + apache-tvm-ffi $TVM_FFI_VERSION from $BUNDLE_DIR (no index)"
START=$(date +%s)
if ! "$PYTHON" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --disable-pip-version-check \
        --target "$SITE_DIR" --find-links "$BUNDLE_DIR" \
        "flashinfer-python==$FI_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION" > "$OUT_DIR/install.log" 2>&1; then
    cat "$OUT_DIR/install.log" >> "$LOG"
    say "FAILED: the bundle does not install with $("$PYTHON" --version 2>&1) (see install.log above)"
    exit 3
fi
say "installed in $(( $(date +%s) - START )) s"

export PYTHONPATH="$SITE_DIR:$REPO/src:$REPO/executors/torch/src:$REPO/executors/flashinfer/src${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_DISABLE_JIT=1
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/phasesched-flashinfer-cache}"
export PYTHONUNBUFFERED=1
cd "$REPO" || exit 3
# shellcheck disable=SC2086  # CHECK_ARGS is a list of words on purpose
timeout --kill-after=15 "$CHECK_TIMEOUT_S" "$PYTHON" "$HERE/check.py" --out "$OUT_DIR" --bundle "$BUNDLE_DIR" \
    --install-log "$OUT_DIR/install.log" --limit-s "$CHECK_TIMEOUT_S" ${CHECK_ARGS:-} 2>&1 | tee -a "$LOG"
STATUS=${PIPESTATUS[0]}
rm -f "$OUT_DIR/install.log"
if [ "$STATUS" -eq 124 ] || [ "$STATUS" -eq 137 ]; then
    say "FAILED: check.py ran past ${CHECK_TIMEOUT_S} s; check.json holds the sections that finished"
    exit 1
fi
say "check.py exited $STATUS; results in $OUT_DIR"
exit "$STATUS"
