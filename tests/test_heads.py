import json
import shutil
from pathlib import Path

import pytest
import torch

from mtp.base import load_base
from mtp.heads import HeadsConfig, MedusaHeads, base_identity
from tests.conftest import TINY_BASE


@pytest.fixture
def config(tiny):
    model, tokenizer = tiny
    return HeadsConfig(num_heads=3, num_layers=2, **base_identity(TINY_BASE, model, tokenizer))


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_new_heads_predict_what_the_base_lm_head_predicts(tiny, config, lm_head):
    model, _ = tiny
    config.lm_head = lm_head
    lm_head_module = model.get_output_embeddings()
    heads = MedusaHeads(config, lm_head_module.weight.detach())
    hidden = torch.randn(2, 5, config.hidden_size)
    logits = heads(hidden, lm_head_module)  # (K, B, T, V)
    assert logits.shape == (3, 2, 5, config.vocab_size)
    for k in range(3):
        assert torch.allclose(logits[k], lm_head_module(hidden), atol=1e-5)


def random_heads(tiny, config, lm_head):
    """(model, heads with random weights: heads that differ from each other and from the base lm_head)."""
    model, _ = tiny
    config.lm_head = lm_head
    heads = MedusaHeads(config, model.get_output_embeddings().weight.detach())
    torch.manual_seed(0)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return model, heads


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_the_first_heads_alone_give_the_first_rows_of_all_heads(tiny, config, lm_head):
    model, heads = random_heads(tiny, config, lm_head)
    hidden = torch.randn(4, config.hidden_size)
    every = heads(hidden, model.get_output_embeddings())  # (3, 4, V)
    first = heads(hidden, model.get_output_embeddings(), num_heads=2)  # (2, 4, V)
    assert first.shape[0] == 2 and torch.equal(first, every[:2]) and not torch.equal(every[1], every[2])


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_guesses_from_a_draft_vocabulary_are_its_best_tokens_by_the_full_logits(tiny, config, lm_head):
    model, heads = random_heads(tiny, config, lm_head)
    hidden, lm_head_module = torch.randn(config.hidden_size), model.get_output_embeddings()
    full = heads(hidden, lm_head_module, num_heads=2)  # (2, V)
    heads.config.draft_vocab = torch.randperm(config.vocab_size)[:40].tolist()
    guesses = heads.guesses(hidden, lm_head_module, num_heads=2, k=5)  # (2, 5)
    outside = torch.ones(config.vocab_size, dtype=torch.bool)
    outside[heads.config.draft_vocab] = False
    expected = full.masked_fill(outside, float("-inf")).topk(5, dim=-1).indices  # the full logits, draft tokens only
    assert torch.equal(guesses, expected)
    assert not torch.equal(guesses, full.topk(5, dim=-1).indices)  # not what the whole vocabulary gives
    heads.config.draft_vocab = None
    assert torch.equal(heads.guesses(hidden, lm_head_module, num_heads=2, k=5), full.topk(5, dim=-1).indices)


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_draft_logits_are_the_full_logits_draft_columns_for_a_new_list_and_carry_gradients_to_own_projections(
    tiny, config, lm_head
):
    model, heads = random_heads(tiny, config, lm_head)
    hidden, lm_head_module = torch.randn(2, 5, config.hidden_size), model.get_output_embeddings()
    full = heads(hidden, lm_head_module)  # (3, 2, 5, V)
    with torch.no_grad():  # decoding: the rows are gathered once and kept
        for size in (40, 60):  # a second list on the same heads: the cached rows of the first must not serve it
            heads.config.draft_vocab = torch.randperm(config.vocab_size)[:size].tolist()
            draft = heads.draft_logits(hidden, lm_head_module)  # (3, 2, 5, size)
            torch.testing.assert_close(draft, full[..., heads.config.draft_vocab])
    draft = heads.draft_logits(hidden, lm_head_module)  # training: in the autograd graph
    torch.testing.assert_close(draft, full[..., heads.config.draft_vocab])
    draft.sum().backward()
    trained = [heads.blocks[0][0].linear.weight] + ([] if lm_head == "shared" else [heads.projections[0].weight])
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in trained)


def test_every_layer_of_every_head_is_its_own_module(config):
    heads = MedusaHeads(config)
    blocks = [block for head in heads.blocks for block in head]
    assert len(blocks) == 6 and len({id(block) for block in blocks}) == 6
    assert len({block.linear.weight.data_ptr() for block in blocks}) == 6


def test_shared_heads_have_no_projection_parameters_and_own_heads_do(config):
    shared = sum(p.numel() for p in MedusaHeads(config).parameters())
    config.lm_head = "own"
    own = sum(p.numel() for p in MedusaHeads(config).parameters())
    assert shared == 3 * 2 * (config.hidden_size**2 + config.hidden_size)
    assert own == shared + 3 * config.hidden_size * config.vocab_size


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_heads_round_trip_through_a_folder(tiny, config, lm_head, tmp_path):
    model, _ = tiny
    config.lm_head = lm_head
    heads = MedusaHeads(config, model.get_output_embeddings().weight.detach())
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter)
    heads.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = MedusaHeads.from_pretrained(tmp_path)
    assert loaded.config == heads.config
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert json.loads((tmp_path / "config.json").read_text())["base_model"] == TINY_BASE


def test_heads_refuse_a_base_they_were_not_trained_for(tiny, config, tmp_path):
    model, tokenizer = tiny
    heads = MedusaHeads(config)
    heads.check_base("a copy of the same model", model, tokenizer)  # same identity under another name: fine
    shutil.copytree(Path(TINY_BASE).parent, tmp_path / "wider")
    other = tmp_path / "wider" / "config.json"
    other.write_text(json.dumps({**json.loads(other.read_text()), "hidden_size": 128}))
    wider, _ = load_base(str(other))
    with pytest.raises(
        ValueError, match=r"trained for base model .*tiny-llama.*hidden 64.*not for .*wider.*hidden 128"
    ):
        heads.check_base(str(other), wider, tokenizer)
    tokenizer_vocab = dict(tokenizer.get_vocab())

    class OtherTokenizer:
        def get_vocab(self):
            return {**tokenizer_vocab, "<extra>": 0}

    with pytest.raises(ValueError, match="tokenizer"):
        heads.check_base("same shapes, other tokenizer", model, OtherTokenizer())


@pytest.mark.parametrize(
    "bad, message",
    [(dict(num_heads=0), "num_heads=0"), (dict(num_layers=0), "num_layers=0"), (dict(lm_head="tied"), "'shared'")],
)
def test_bad_head_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        HeadsConfig(**bad)


def test_loading_from_a_folder_without_heads_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        MedusaHeads.from_pretrained(tmp_path)
