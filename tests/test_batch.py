"""Batched tree decoding: every row's output is its prompt's own, decoded alone, whatever the other rows of the
batch hold, accept or stop at."""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from mtp.base import load_tokenizer
from mtp.decoding.batch import Batch
from mtp.decoding.cache import append_rows, attention_windows, keep_accepted, keep_rows, tree_attention_mask
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import Lookup
from mtp.decoding.pacing import Pacer, Plan
from mtp.decoding.sampling import Sampling
from mtp.decoding.tree import DynamicTree, Tree
from tests.conftest import (
    SLIDING,
    TINY_BASE,
    TREE,
    OracleHeads,
    chi_square_z,
    exact_joint,
    random_heads,
    reference,
    small_vocab_decoder,
    tiny_model,
)

# prompts of 1 to 12 tokens: rows of different lengths share the cache from the first step
PROMPTS = ["Count from 3 to 40: 3, 4, 5, 6,", "Hi", "The quick brown fox jumps over the lazy dog", "a b a b a b a"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "gpt_neox": ("gpt_neox", {}),
    "mistral-window16": ("mistral", SLIDING["mistral"]),  # every layer slides
    "gemma2-window16": ("gemma2", SLIDING["gemma2"]),  # full and sliding layers, soft caps
}


@pytest.mark.parametrize("tree", [TREE, DynamicTree(8, 4, 3)], ids=["static", "dynamic"])
@pytest.mark.parametrize("heads", ["oracle", "medusa", "hydra", "eagle"])
@pytest.mark.parametrize("name", MODELS)
def test_each_row_of_a_batch_is_its_prompt_decoded_alone(name, heads, tree, tokenizer):
    model_type, overrides = MODELS[name]
    model = tiny_model(model_type, **overrides)
    prompts = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
    alone = [reference(model, input_ids, 40) for input_ids in prompts]  # each prompt alone, no early stop
    # EOS: the first token of prompt 0's output that is new after its sixth, so that row stops early (inside an
    # accepted block, with the oracle) while the others go on, and the fourth prompt takes its place
    eos = next(token for i, token in enumerate(alone[0]) if i >= 6 and token not in alone[0][:i])
    model.generation_config.eos_token_id = eos
    expected = [tokens[: tokens.index(eos)] if eos in tokens else tokens for tokens in alone]
    if heads == "oracle":
        runs = [torch.cat([ids[0], torch.tensor(tokens)]) for ids, tokens in zip(prompts, alone, strict=True)]
        drafter = OracleHeads(model, runs, num_heads=4)
    else:
        drafter = random_heads(model, head_type=heads)
    results = Decoder(model, tokenizer, drafter, tree).generate(PROMPTS, max_new_tokens=40, batch_size=3)
    assert [result.token_ids for result in results] == expected
    assert [result.finish_reason for result in results] == ["stop" if eos in t else "length" for t in alone]
    assert len(expected[0]) < 40 and any(len(tokens) == 40 for tokens in expected)  # some rows stopped early
    if heads == "oracle":  # rows accepted whole blocks, at their own pace
        assert all(result.tau > 2.5 for result in results if len(result.token_ids) > 10)


def test_finished_rows_leave_the_batch_and_waiting_prompts_take_their_place(tokenizer, monkeypatch):
    sizes = []  # rows verified by each pass
    step = Batch.step
    monkeypatch.setattr(Batch, "step", lambda batch: sizes.append(len(batch.rows)) or step(batch))
    model = tiny_model()
    prompts = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
    model.generation_config.eos_token_id = reference(model, prompts[1], 5)[4]  # prompt 1 ends after <= 4 tokens
    decoder = Decoder(model, tokenizer, random_heads(model), TREE)
    results = decoder.generate(PROMPTS, max_new_tokens=30, batch_size=2)
    assert max(sizes) == 2 and sizes[-1] == 1  # never more than 2 rows; the last row alone at the end
    assert sum(sizes) == sum(result.forward_passes for result in results)  # a finished row costs no more work
    assert len(results[1].token_ids) < 5 and results[1].finish_reason == "stop"
    assert [result.token_ids for result in results] == [decoder.generate(prompt, 30).token_ids for prompt in PROMPTS]


def test_a_sampled_prompt_draws_the_same_tokens_whatever_its_batch_and_answers_come_as_they_end(tokenizer):
    """Prompt i of a list draws from its own generator (seeded from the seed and i): alone or in a batch of 3, its
    sample is its own; `Decoder.answers` yields each result as its answer ends, seeded by the number given."""
    model = tiny_model()
    decoder, sampling = Decoder(model, tokenizer, random_heads(model), TREE), Sampling(temperature=1.0, seed=7)
    one, three = (decoder.generate(PROMPTS, 24, sampling=sampling, batch_size=size) for size in (1, 3))
    assert [r.token_ids for r in one] == [r.token_ids for r in three]
    assert len({tuple(r.token_ids) for r in one}) == len(PROMPTS)
    ends = list(decoder.answers(PROMPTS[:2], 24, sampling, batch_size=2, numbers=[1, 0]))  # numbers swapped
    assert sorted(index for index, _ in ends) == [0, 1] and all(result.token_ids for _, result in ends)
    swapped = {index: result.token_ids for index, result in ends}
    reversed_list = decoder.generate([PROMPTS[1], PROMPTS[0]], 24, sampling=sampling)  # prompt 0 numbered 1
    assert [swapped[0], swapped[1]] == [reversed_list[1].token_ids, reversed_list[0].token_ids]


def test_a_step_over_more_rows_takes_the_tree_planned_for_that_many(tokenizer):
    model = tiny_model()
    prompts = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS[:3]]
    alone = [reference(model, input_ids, 40) for input_ids in prompts]
    runs = [torch.cat([ids[0], torch.tensor(tokens)]) for ids, tokens in zip(prompts, alone, strict=True)]
    root_alone = Plan(Tree.from_paths([]))  # two rows or more: plain one-token steps
    pacer = Pacer({1: [(Plan(TREE), 1.0)], 2: [(root_alone, 1.0)]})
    decoder = Decoder(model, tokenizer, OracleHeads(model, runs, 4), pacer=pacer)
    results = decoder.generate(PROMPTS[:3], max_new_tokens=30, batch_size=2)
    assert [result.token_ids for result in results] == [tokens[:30] for tokens in alone]
    # prompts 0 and 1 step together, a token a pass, and end together; prompt 2 then runs alone on TREE
    assert results[0].acceptance.lengths == results[1].acceptance.lengths == [1] * 29
    assert results[2].tau > 2.5


@pytest.mark.parametrize("name", ["llama", "gemma2-window3"])
def test_rows_of_different_lengths_attend_as_causal_runs_after_uneven_acceptance(name):
    """The batch's mask lets each row's tree nodes see exactly their own prefix and ancestors (a window of 3
    cuts both in gemma2's sliding layers), across empty slots: the padding of the shorter prompt and the slots a
    row did not fill with accepted nodes. Dropping a row keeps the other's attention as it was."""
    model = tiny_model("gemma2", **(SLIDING["gemma2"] | {"sliding_window": 3})) if name != "llama" else tiny_model()
    windows = attention_windows(model.config)
    generator = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(0, 512, (n,), generator=generator) for n in (9, 4)]
    tokens = torch.randint(0, 512, (2, TREE.size), generator=generator)  # any token at any node

    def causal(row: int, ids: torch.Tensor) -> torch.Tensor:  # (len(ids), V) row's prefix then ids, alone
        return model(torch.cat([prefixes[row], ids])[None]).logits[0, len(prefixes[row]) :]

    def next_token(cache, slots, prefix_lens, rows) -> torch.Tensor:  # one more token per row, tokens[:, 0]
        mask = tree_attention_mask(
            torch.ones(len(rows), 1, 1, dtype=torch.bool), prefix_lens[:, None], slots, windows, torch.float32
        )
        logits = model(tokens[rows, :1], cache=cache, attention_mask=mask, position_ids=prefix_lens[:, None]).logits
        return logits[:, 0], keep_accepted(cache, slots, [torch.tensor([0])] * len(rows), prefix_lens)

    with torch.no_grad():
        cache, other = DynamicCache(), DynamicCache()  # every position on every layer, as the decoder's
        for prefix, prefill in zip(prefixes, (cache, other), strict=True):
            model(prefix[None], cache=prefill, use_cache=True)
        slots = append_rows(cache, torch.arange(9)[None], other, torch.arange(4)[None])  # (2, 9): 5 empty in row 1
        prefix_lens = torch.tensor([9, 4])
        positions = prefix_lens[:, None] + TREE.depths  # (2, N+1)
        mask = tree_attention_mask(TREE.mask.expand(2, -1, -1), positions, slots, windows, torch.float32)
        tree_logits = model(tokens, cache=cache, attention_mask=mask, position_ids=positions).logits  # (2, N+1, V)
        for row in (0, 1):
            for path in TREE.retrieve:
                nodes = path[path >= 0]
                torch.testing.assert_close(
                    tree_logits[row, nodes], causal(row, tokens[row, nodes]), atol=1e-5, rtol=1e-4
                )
        deepest = TREE.retrieve[-1][TREE.retrieve[-1] >= 0]
        accepted = [deepest[:4], deepest[:1]]  # row 0: root and 3 candidates; row 1: its root alone
        slots = keep_accepted(cache, slots, accepted, prefix_lens)  # (2, 13): 3 more empty slots in row 1
        assert slots.shape == (2, 13) and (slots[1] >= 0).sum() == 5
        prefix_lens += torch.tensor([4, 1])
        after, slots = next_token(cache, slots, prefix_lens, [0, 1])
        for row in (0, 1):
            ids = torch.cat([tokens[row, accepted[row]], tokens[row, :1]])
            torch.testing.assert_close(after[row], causal(row, ids)[-1], atol=1e-5, rtol=1e-4)
        slots = keep_rows(cache, slots, torch.tensor([False, True]))  # row 0 leaves
        assert slots.shape == (1, 6) and sorted(slots[0].tolist()) == list(range(6))  # row 1's 6 slots, no empty
        after, _ = next_token(cache, slots, prefix_lens[1:] + 1, [1])
        ids = torch.cat([tokens[1, accepted[1]], tokens[1, :1], tokens[1, :1]])
        torch.testing.assert_close(after[0], causal(1, ids)[-1], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("lookup", [None, Lookup((3, 3))])
def test_each_row_samples_its_own_prompts_distribution(lookup):
    """Rows of two prompts (3 and 6 tokens) sampled together, 64 to a batch: each prompt's continuations follow
    the base model's exact joint distribution of that prompt (4,000 each; a row accepting with its neighbour's
    logits gives z near 200, seen)."""
    decoder, sampling = small_vocab_decoder(lookup=lookup), Sampling(temperature=1.0, seed=0)
    prompts = [torch.tensor([[3, 7, 1]]), torch.tensor([[5, 2, 6, 0, 4, 3]])]
    found, settled = [Counter(), Counter()], Counter()
    for i in range(125):
        batch = decoder.batch(replace(sampling, seed=i))
        rows = [[batch.add(prompts[b % 2])] for b in range(64)]
        while min(len(tokens) for tokens in rows) < 3:
            for tokens, (block, _) in zip(rows, batch.step(), strict=True):
                tokens += block
                settled[len(block) > 1] += 1
        for b, tokens in enumerate(rows):
            found[b % 2][tuple(tokens[:3])] += 1
    assert settled[True] > 1000 and settled[False] > 1000  # acceptances and rejections
    for prompt, counts in zip(prompts, found, strict=True):
        assert chi_square_z(counts, exact_joint(decoder.base_model, sampling, prompt)) < 4


def test_bad_batches_are_clear_errors(tokenizer):
    decoder = Decoder(tiny_model(), tokenizer)
    with pytest.raises(ValueError, match="batch_size=0: decode at least 1 prompt at a time"):
        decoder.generate(PROMPTS, batch_size=0)
    with pytest.raises(ValueError, match="Prompt 2 of 3: The prompt is empty"):
        decoder.generate(["Hi", " ", "Hello"], batch_size=2)


# RoPE whose frequencies follow the longest sequence of a pass: dynamic NTK (changes past max_position_embeddings,
# the context window) and longrope (short factors up to original_max_position_embeddings, long past it)
LENGTH_ROPE = {
    "dynamic": (
        "llama",
        {"max_position_embeddings": 48, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
    ),
    "longrope": (
        "phi3",
        {
            "max_position_embeddings": 128,
            "original_max_position_embeddings": 48,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0] * 8,
                "long_factor": [4.0] * 8,
                "original_max_position_embeddings": 48,
            },
        },
    ),
}


@pytest.mark.parametrize("name", LENGTH_ROPE)
def test_rope_that_follows_the_passs_length_is_exact_up_to_its_limit_alone_and_in_batches(name, tokenizer):
    """Decoding to the last token before the limit (the context window for dynamic NTK, the original length for
    longrope), alone and two prompts of different lengths in one batch, equals each prompt's plain greedy
    decoding; past a longrope model's original length a request is refused before any work (let through, it
    would differ: the long factors change every position's frequencies)."""
    model_type, config = LENGTH_ROPE[name]
    model, limit = tiny_model(model_type, **config), 48
    with torch.no_grad():  # attention sharp enough that the frequencies show (a fresh init's is near uniform)
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                parameter.mul_(8)
    prompts = [PROMPTS[0], PROMPTS[2]]
    ids = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    expected = [reference(model, i, limit - i.shape[1]) for i in ids]
    decoder = Decoder(model, tokenizer, random_heads(model, head_type="hydra"), TREE, Lookup((3, 3)))
    alone = [decoder.generate(p, max_new_tokens=limit - i.shape[1]) for p, i in zip(prompts, ids, strict=True)]
    assert [result.token_ids for result in alone] == expected
    new = limit - max(i.shape[1] for i in ids)  # one max_new_tokens for both: the shorter prompt stops short of it
    together = decoder.generate(prompts, max_new_tokens=new, batch_size=2)
    assert [result.token_ids for result in together] == [e[:new] for e in expected]
    past = limit - ids[0].shape[1] + 1  # one token past the limit
    if name == "dynamic":  # dynamic NTK's limit is the context window, which no request passes
        with pytest.raises(ValueError, match="past the model's context window of 48 tokens"):
            decoder.generate(prompts[0], max_new_tokens=past)
    if name == "longrope":
        with pytest.raises(ValueError, match=r"past 48, where phi3's longrope RoPE switches.*max_new_tokens at most"):
            decoder.generate(prompts[0], max_new_tokens=past)
        decoder.target.rope_limit, new = None, 100 - ids[0].shape[1]
        assert decoder.generate(prompts[0], max_new_tokens=new).token_ids != reference(model, ids[0], new)


def test_eagle_with_lookup_on_planned_dynamic_trees_decodes_batches_to_the_context_end_and_stops_as_alone(tokenizer):
    """The feature-level drafter and prompt lookup on a dynamic tree that the pacer plans for two rows (a static one
    for one), rows that reach the last position of the context window, and a stop sequence: every row as alone."""
    model = tiny_model(max_position_embeddings=48)
    prompts = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS[:3]]
    new = 48 - max(ids.shape[1] for ids in prompts)  # the longest prompt fills the window
    expected = [reference(model, ids, new) for ids in prompts]
    pacer = Pacer({1: [(Plan(TREE, Lookup((3, 3))), 1.0)], 2: [(Plan(DynamicTree(6, 3, 2), Lookup((3, 3))), 1.0)]})
    decoder = Decoder(model, tokenizer, random_heads(model, head_type="eagle"), pacer=pacer)
    results = decoder.generate(PROMPTS[:3], max_new_tokens=new, batch_size=2)
    assert [result.token_ids for result in results] == expected
    stop = tokenizer.decode(expected[1][5:7])  # ends prompt 1's answer early, the others' maybe
    stopped = decoder.generate(PROMPTS[:3], max_new_tokens=new, stop=[stop], batch_size=2)
    alone = [decoder.generate(prompt, max_new_tokens=new, stop=[stop]) for prompt in PROMPTS[:3]]
    assert [(r.text, r.token_ids, r.finish_reason) for r in stopped] == [
        (r.text, r.token_ids, r.finish_reason) for r in alone
    ]
    assert stopped[1].finish_reason == "stop" and len(stopped[1].token_ids) <= 7
