#!/usr/bin/env bash
# CI for phasesched-vllm: build (or reuse) a CPU-only vLLM 0.32.0 virtual environment, install
# phasesched, the adapter and the example plugin into it, type-check the adapter and run the
# differential tests against vLLM's own scheduler. Needs python3.11 and the local CPU torch
# 2.13.0 wheel ($PIP_FIND_LINKS, or TORCH_WHL). About 3.7 GB; the venv build takes a few minutes
# (the recipe of shared/peers/vllm_sched/setup_venv.sh, copied here), the tests a few more.
#
#   ROOT=/tmp/vllm-peer bash integrations/vllm/ci.sh    # reuse a venv built there before
#   PHASESCHED_VLLM_EXAMPLES=500 bash integrations/vllm/ci.sh    # more generated workloads
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
ROOT="${ROOT:-$REPO/.venv-vllm}"
VENV="$ROOT/venv"
TORCH_WHL="${TORCH_WHL:-${PIP_FIND_LINKS:-/opt/wheels}/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"

if ! "$VENV/bin/python" -c "import vllm, torch" >/dev/null 2>&1; then
    mkdir -p "$ROOT/wheels"
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install -q -U pip
    # torch 2.13.0+cpu satisfies vllm 0.32.0's torch==2.13.0 pin; no CUDA library is downloaded.
    "$VENV/bin/pip" install -q "$TORCH_WHL"
    "$VENV/bin/pip" download -q vllm==0.32.0 --no-deps -d "$ROOT/wheels"
    "$VENV/bin/pip" install -q --no-deps "$ROOT"/wheels/vllm-0.32.0-*.whl
    "$VENV/bin/pip" install -q -r "$HERE/ci/requirements-cpu-subset.txt"
fi
"$VENV/bin/pip" install -q "pytest>=8" "hypothesis>=6.100" "attrs>=23.1" "mypy>=1.10"
"$VENV/bin/pip" install -q --no-deps -e "$REPO" -e "$HERE" -e "$REPO/examples/custom_policy"
"$VENV/bin/python" -c "import vllm; assert vllm.__version__ == '0.32.0', vllm.__version__"

cd "$HERE"
"$VENV/bin/python" -m mypy src/phasesched_vllm tests benchmarks
export PHASESCHED_VLLM_EXAMPLES="${PHASESCHED_VLLM_EXAMPLES:-200}"  # per property: about 1,300 workloads, 2 minutes
"$VENV/bin/python" -m pytest -q -p no:logging -p no:cacheprovider tests
