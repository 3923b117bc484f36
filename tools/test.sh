#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (the README's test command; .ci/run calls it).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# torch first, pinned: on these machines 2.13.0 is a local CPU wheel (a bare `torch` would fetch CUDA builds)
$py -m pip install -q torch==2.13.0 || exit 1
# the compile checks (tests/test_kernels_compile.py) read ptxas's register and spill counts, which move with the
# ptxas that Triton bundles: the suite is kept clean on 3.9.0 (3.8.0 spills 4 B in one sm_90 MMA variant)
$py -m pip install -q triton==3.9.0 || $py -m pip install -q "triton>=3.6" || exit 1
$py -m pip install -q -e ".[test]" || exit 1
# flash-linear-attention importable on a CPU box breaks transformers' CPU path for qwen3_5
$py -m pip uninstall -q -y fla-core flash-linear-attention causal-conv1d >/dev/null 2>&1 || true
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
$py -m pytest -q "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi
exit $rc
