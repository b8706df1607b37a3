"""FasterDecoding Medusa checkpoints load as our heads: the same logits, lossless decoding, clear errors."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch.nn import functional as F

import mtp
from mtp.drafters.contract import Drafter
from tests.conftest import TINY_BASE, plain_answer

HIDDEN, VOCAB = 64, 512  # the tiny model's


def faster_decoding_checkpoint(folder, num_heads=3, num_layers=2, suffix="safetensors", base=TINY_BASE) -> dict:
    """Random heads written as FasterDecoding/Medusa writes them; returns the weights."""
    torch.manual_seed(0)
    weights = {}
    for h in range(num_heads):
        for i in range(num_layers):
            weights[f"{h}.{i}.linear.weight"] = torch.randn(HIDDEN, HIDDEN) * 0.2
            weights[f"{h}.{i}.linear.bias"] = torch.randn(HIDDEN) * 0.2
        weights[f"{h}.{num_layers}.weight"] = torch.randn(VOCAB, HIDDEN)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": base}
    (folder / "config.json").write_text(json.dumps(config))
    if suffix == "safetensors":
        save_file(weights, folder / "medusa_lm_head.safetensors")
    else:
        torch.save(weights, folder / "medusa_lm_head.pt")
    return weights


@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_a_medusa_checkpoint_loads_as_heads_with_the_same_logits(tmp_path, suffix):
    weights = faster_decoding_checkpoint(tmp_path, suffix=suffix)
    heads = Drafter.from_pretrained(tmp_path)
    assert heads.config.num_heads == 3 and heads.config.num_layers == 2 and heads.config.lm_head == "own"
    assert heads.config.base_model == TINY_BASE and heads.config.hidden_size == HIDDEN
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = []
    for h in range(3):  # Medusa's head: residual blocks, then its own projection
        x = hidden
        for i in range(2):
            x = x + F.silu(F.linear(x, weights[f"{h}.{i}.linear.weight"], weights[f"{h}.{i}.linear.bias"]))
        expected.append(x @ weights[f"{h}.2.weight"].T)
    with torch.no_grad():
        torch.testing.assert_close(heads(hidden, None), torch.stack(expected))


def test_an_imported_checkpoint_decodes_exactly_as_plain_greedy(tmp_path):
    faster_decoding_checkpoint(tmp_path)
    decoder = mtp.load(str(tmp_path), tree="small")
    prompt = "Count from 3 to 40: 3, 4, 5, 6,"
    result = decoder.generate(prompt, max_new_tokens=24)
    input_ids = decoder.tokenizer(prompt, return_tensors="pt").input_ids
    expected = plain_answer(decoder.base_model, input_ids, 24, decoder.eos_ids)  # the whole answer, its length too
    assert result.token_ids == expected and (result.finish_reason == "stop") == (len(expected) < 24)


def test_a_broken_or_mismatched_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors"):
        Drafter.from_pretrained(tmp_path / "none")
    faster_decoding_checkpoint(tmp_path / "short", num_heads=2)
    config = json.loads((tmp_path / "short" / "config.json").read_text()) | {"medusa_num_heads": 3}
    (tmp_path / "short" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks.*not the heads of a 3-head Medusa checkpoint"):
        Drafter.from_pretrained(tmp_path / "short")
    faster_decoding_checkpoint(tmp_path / "wide", base=TINY_BASE)
    wide = Drafter.from_pretrained(tmp_path / "wide")
    wide.config.hidden_size = 32  # as if trained for a narrower model
    model, tokenizer = mtp.base.load_base(TINY_BASE)
    with pytest.raises(ValueError, match="trained for base model"):
        wide.check_base(TINY_BASE, model, tokenizer)
