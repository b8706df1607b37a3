#!/usr/bin/env bash
# Set up (or reuse) the environment, then run the whole test suite, one worker per core (pytest-xdist; each test
# runs whole in one worker). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -n auto --dist worksteal "$@"
