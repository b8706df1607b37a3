"""Sliding-window attention: tree decoding well past the window is still the base model's own greedy decoding,
on models whose every layer slides (Mistral, Phi-3) and on models that mix full and sliding layers (Qwen2 with
use_sliding_window, Gemma-3, Gemma-2 with its final logit soft cap)."""

import pytest
import torch
from transformers import DynamicCache

from mtp.decoding.cache import attention_windows, keep_accepted, tree_attention_mask
from mtp.decoding.decoder import Decoder
from tests.conftest import SLIDING, TREE, WINDOW, OracleHeads, passes, random_heads, reference, tiny_model

PROMPT = torch.tensor([[5, 77, 300, 12, 9, 41, 250, 3, 18, 460, 101, 66]])  # 12 tokens: the window is passed soon


def test_the_window_of_each_layer_type_is_read_from_the_config():
    assert attention_windows(tiny_model("llama").config) == {"full_attention": None}
    assert attention_windows(tiny_model("mistral", **SLIDING["mistral"]).config) == {"sliding_attention": WINDOW}
    mixed = tiny_model("qwen2", **SLIDING["qwen2"]).config
    assert attention_windows(mixed) == {"full_attention": None, "sliding_attention": WINDOW}
    chunked = tiny_model("qwen2", layer_types=["full_attention", "chunked_attention"]).config
    with pytest.raises(ValueError, match=r"type \['chunked_attention'\]: tree decoding supports"):
        attention_windows(chunked)


@pytest.mark.parametrize("model_type", SLIDING)
def test_greedy_tree_decoding_far_past_the_window_equals_generate(model_type):
    model = tiny_model(model_type, **SLIDING[model_type])
    expected = reference(model, PROMPT, 88)
    oracle = OracleHeads(model, torch.cat([PROMPT[0], torch.tensor(expected)]), num_heads=4)
    tokens, lengths = [], []
    for heads in (oracle, *(random_heads(model, head_type=kind) for kind in ("medusa", "hydra", "eagle"))):
        loop = passes(Decoder(model, None, heads, TREE), PROMPT)
        run = []
        while len(run) < 80:  # 12 + 80 positions: more than five windows
            block, _ = next(loop)
            run += block
            lengths.append(len(block))
        tokens.append(run[:80])
    assert tokens == [expected[:80]] * 4
    assert max(lengths) == 5  # the oracle's blocks were accepted whole, across the window's edge


@pytest.mark.parametrize("model_type", SLIDING)
def test_the_windowed_tree_mask_equals_causal_attention_along_every_path(model_type):
    """A window of 3 cuts the prefix and also a deep node's oldest ancestors: each path's logits must still be
    those of a causal run of prefix + path, the window applied by the model itself. With exact acceptance
    pinned on its own (test_acceptance), equal logits at every node are what keeps sampling exact."""
    model = tiny_model(model_type, **(SLIDING[model_type] | {"sliding_window": 3}))
    tokens = torch.randint(0, 512, (TREE.size,), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    prefix_len = PROMPT.shape[1]
    with torch.no_grad():
        model(PROMPT, cache=cache, use_cache=True)
        slots = torch.arange(prefix_len)[None]  # (1, P) the prompt's positions
        positions = (prefix_len + TREE.depths)[None]  # (1, N+1)
        mask = tree_attention_mask(TREE.mask[None], positions, slots, attention_windows(model.config), torch.float32)
        tree_logits = model(tokens[None], cache=cache, attention_mask=mask, position_ids=positions).logits[0]
        for path in TREE.retrieve:
            nodes = path[path >= 0]
            causal = model(torch.cat([PROMPT[0], tokens[nodes]])[None]).logits[0, prefix_len:]  # (len, V)
            torch.testing.assert_close(tree_logits[nodes], causal, atol=1e-5, rtol=1e-4)
        # then the next pass sees what a causal run would have cached
        keep_accepted(cache, slots, [nodes[:4]], torch.tensor([prefix_len]))
        after = model(tokens[:1, None], cache=cache, position_ids=torch.tensor([[prefix_len + 4]])).logits[0, -1]
        causal = model(torch.cat([PROMPT[0], tokens[nodes[:4]], tokens[:1]])[None]).logits[0, -1]
    torch.testing.assert_close(after, causal, atol=1e-5, rtol=1e-4)


def test_the_final_logit_soft_cap_is_applied_to_the_verified_logits():
    model = tiny_model("gemma2", **SLIDING["gemma2"])
    hidden = 100 * torch.randn(3, 64)  # logits far past the cap of 30
    with torch.no_grad():
        capped = Decoder(model, None).target.logits(hidden)
        uncapped = model.lm_head(hidden)
    assert capped.abs().max() <= 30 and torch.allclose(capped, 30 * torch.tanh(uncapped / 30))
