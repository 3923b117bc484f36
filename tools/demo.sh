#!/usr/bin/env bash
# The README's main job on the embedded default: set up, build/pack the tiny model, verify, generate with MTP.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
$py -m pip install -q torch==2.13.0
$py -m pip install -q -e ".[serve]"
out=${OUT_DIR:-out/demo}
$py -m ninfer_pack.demo "$out"
