"""Bad input on the command line ends each command with one line that names the bad value and the fix, and a
non-zero exit status: never a traceback."""

import sys

import pytest

import decode
import mtp.tools.bench
import mtp.tools.sizing
import train
from mtp.base import load_base
from mtp.drafters.contract import DrafterConfig, base_identity
from mtp.drafters.heads import MedusaHeads
from tests.conftest import DATA, ROOT, TINY_BASE, save_random_heads

MISSING = "/nowhere/heads"


def wrong_base_heads(tmp_path) -> str:
    """Heads trained for another base model (hidden size 32, not the tiny model's 64)."""
    model, tokenizer = load_base(TINY_BASE)
    identity = {**base_identity("a narrower model", model, tokenizer), "hidden_size": 32}
    MedusaHeads(DrafterConfig(num_heads=2, **identity)).save_pretrained(tmp_path / "wrong")
    return str(tmp_path / "wrong")


CASES = {
    "empty prompt": (decode.main, ["--base-model", TINY_BASE, "--prompt", ""], "The prompt is empty"),
    "blank prompt": (decode.main, ["--base-model", TINY_BASE, "--prompt", "  \n"], "The prompt is empty"),
    "negative max_new_tokens": (
        decode.main,
        ["--base-model", TINY_BASE, "--prompt", "Hi", "--max-new-tokens", "-3"],
        "max_new_tokens=-3: use 0 or a positive number",
    ),
    "past the context": (
        decode.main,
        ["--base-model", TINY_BASE, "--prompt", "Hi", "--max-new-tokens", "5000"],
        "past the model's context window of 2048 tokens: lower max_new_tokens to at most",
    ),
    "missing heads": (decode.main, ["--heads", MISSING, "--prompt", "Hi"], f"{MISSING}/config.json does not exist"),
    "wrong-base heads": (
        decode.main,
        ["--heads", "WRONG", "--base-model", TINY_BASE, "--prompt", "Hi"],
        "trained for base model",
    ),
    "bad top_p": (decode.main, ["--base-model", TINY_BASE, "--prompt", "Hi", "--top-p", "0"], "top_p=0.0"),
    "missing base model": (decode.main, ["--base-model", "/nowhere/model", "--prompt", "Hi"], "Unknown base model"),
    "bench past the context": (
        mtp.tools.bench.main,
        ["--heads", "HEADS", "--questions", str(DATA / "mt_bench.jsonl"), "--limit", "1", "--max-new-tokens", "5000"],
        "past the model's context window",
    ),
    "bench missing questions": (
        mtp.tools.bench.main,
        ["--heads", "HEADS", "--questions", "/nowhere/q.jsonl"],
        "'/nowhere/q.jsonl' does not exist",
    ),
    "bench trees unpaired": (
        mtp.tools.bench.main,
        [
            "--heads",
            "HEADS",
            "--questions",
            str(DATA / "mt_bench.jsonl"),
            "--against",
            "HEADS",
            "--against",
            "HEADS",
            "--against-tree",
            "3",
        ],
        "--against-tree given 1 times for 2 --against drafters",
    ),
    "sizing missing heads": (mtp.tools.sizing.main, ["--heads", MISSING], "does not exist"),
    "sizing without calibration": (mtp.tools.sizing.main, ["--heads", "HEADS"], "has no calibration"),
    "train missing data": (
        train.main,
        ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--data.data", "/nowhere/data.jsonl"],
        "'/nowhere/data.jsonl' does not exist",
    ),
    "train bad lm_head": (
        train.main,
        ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--model.drafter.lm_head", "tied"],
        "lm_head='tied': choose 'shared'",
    ),
    "train flat model key": (
        train.main,
        ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--model.lr", "0.1"],
        "rename model.lr -> model.optim.lr",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_a_non_zero_exit(case, tmp_path, monkeypatch, capsys):
    main, arguments, message = CASES[case]
    heads = save_random_heads(tmp_path)[0] if "HEADS" in arguments else None
    arguments = [heads if a == "HEADS" else wrong_base_heads(tmp_path) if a == "WRONG" else a for a in arguments]
    monkeypatch.setattr(sys, "argv", ["command", *arguments])
    with pytest.raises(SystemExit) as done:
        main(arguments) if main is train.main else main()
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err[-1000:]
    assert err.count("\n") == 1, err[-1000:]  # one line
