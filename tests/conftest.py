import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub; set before transformers is imported

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_BASE = str(ROOT / "configs" / "models" / "tiny-llama" / "config.json")
TINY_CHAT = str(ROOT / "data" / "tiny_chat.jsonl")
DATA = ROOT / "data"


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the randomly initialised tiny Llama."""
    from mtp.base import load_base

    return load_base(TINY_BASE)
