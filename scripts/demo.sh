#!/usr/bin/env bash
# Set up (or reuse) the environment, then train heads on the packaged SmolLM2 (configs/smollm2-demo.yaml)
# and print their per-head validation accuracy. Extra arguments go to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python train.py fit --config configs/smollm2-demo.yaml "$@"
