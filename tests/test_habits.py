"""Decoding as users call it: inside `torch.inference_mode()`, `torch.no_grad()` or with gradients on, for every
drafter kind and kind of tree, greedy and sampled, alone and in batches."""

from contextlib import nullcontext

import pytest
import torch

from mtp.base import load_tokenizer
from mtp.decoding.decoder import Decoder
from mtp.decoding.pacing import Candidate, Pacer, Plan
from mtp.decoding.sampling import Sampling
from mtp.decoding.tree import DynamicTree, Tree
from tests.conftest import PROMPT, TINY_BASE, TREE, random_heads, reference, tiny_model

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": nullcontext}
PROMPTS = [PROMPT, "Name three primary colours:"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


def decoder_with(tree_kind: str, head_type: str, tokenizer) -> Decoder:
    model = tiny_model()
    heads = random_heads(model, num_heads=4, head_type=head_type)
    if tree_kind == "paced":  # plain steps or the tree, chosen step by step (the tree expected to pay at first)
        plain, tree = Candidate(1), Candidate(TREE.size, (), 1.0, depth=TREE.depth)
        pacer = Pacer({1: [(Plan(Tree.from_paths([]), None, plain), 1.0), (Plan(TREE, None, tree), 1.1)]})
        return Decoder(model, tokenizer, heads, pacer=pacer)
    return Decoder(model, tokenizer, heads, TREE if tree_kind == "fixed" else DynamicTree(8, 3, 2))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("tree_kind", ["fixed", "paced", "dynamic"])
@pytest.mark.parametrize("head_type", ["medusa", "hydra", "eagle"])
def test_decoding_is_alike_under_inference_mode_no_grad_and_gradients(head_type, tree_kind, sampled, tokenizer):
    decoder = decoder_with(tree_kind, head_type, tokenizer)
    sampling = Sampling(temperature=0.8, top_k=20, seed=3) if sampled else Sampling()
    answers = {}
    for name, mode in MODES.items():
        with mode():
            alone = decoder.generate(PROMPT, max_new_tokens=12, sampling=sampling).token_ids
            batched = decoder.generate(PROMPTS, max_new_tokens=12, sampling=sampling, batch_size=2)
        answers[name] = alone, [result.token_ids for result in batched]
    if not sampled:  # lossless, whatever the mode
        expected = [reference(decoder.base_model, tokenizer(p, return_tensors="pt").input_ids, 12) for p in PROMPTS]
        assert answers["grad"] == (expected[0], expected)
    assert answers["inference_mode"] == answers["no_grad"] == answers["grad"]
    assert not any(p.grad is not None for p in decoder.base_model.parameters())
