"""Tree decoding is lossless: greedy output equals the base model's own greedy output, token for token."""

import os
import types

import pytest
import torch
from transformers import DynamicCache

from mtp.base import load_tokenizer
from mtp.decoding.cache import GQA_SWITCH, grouped_keys, keep_accepted
from mtp.decoding.decoder import Decoder
from mtp.decoding.tree import Tree
from mtp.drafters.contract import Drafter, DrafterConfig
from mtp.drafters.heads import MedusaHeads
from tests.conftest import PROMPT, TINY_BASE, TREE, OracleHeads, random_heads, reference, tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


@pytest.mark.parametrize("head_type", Drafter.kinds)
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "phi3", "gpt_neox"])
def test_random_heads_give_the_base_models_greedy_output(model_type, head_type, tokenizer):
    model = tiny_model(model_type)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    heads = random_heads(model, head_type=head_type)
    result = Decoder(model, tokenizer, heads, TREE).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == reference(model, input_ids, 40)
    assert result.finish_reason == "length" and result.forward_passes == len(result.acceptance.lengths)
    assert sum(result.acceptance.lengths) >= 40 - 1  # every pass settles at least its bonus token


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "phi3", "gpt_neox"])
def test_oracle_heads_give_the_same_output_in_far_fewer_passes(model_type, tokenizer):
    model = tiny_model(model_type)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, input_ids, 48)
    oracle = OracleHeads(model, torch.cat([input_ids[0], torch.tensor(expected)]), num_heads=4)
    result = Decoder(model, tokenizer, oracle, TREE).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == expected[:40]
    lengths = result.acceptance.lengths
    assert sum(n > 1 for n in lengths) > 0.8 * len(lengths)  # most steps accept more
    assert result.tau > 3


def test_a_step_runs_only_the_heads_its_tree_reaches(tokenizer):
    model = tiny_model()
    heads, asked = random_heads(model), []
    guess = heads.guess
    heads.guess = lambda hidden, following, head, k, lm_head: (
        asked.append(head) or guess(hidden, following, head, k, lm_head)
    )
    shallow = Tree.from_paths([(0,), (1,), (0, 0)])  # depth 2: heads 0 and 1 of 4
    result = Decoder(model, tokenizer, heads, shallow).generate(PROMPT, max_new_tokens=12)
    assert result.token_ids == reference(model, tokenizer(PROMPT, return_tensors="pt").input_ids, 12)
    assert asked[:2] == [0, 1] and set(asked) == {0, 1}  # head 1 skipped only where the output's end cuts the tree


def test_heads_with_a_draft_vocabulary_guess_only_its_tokens_and_give_the_base_models_greedy_output(tokenizer):
    """Every token the heads put in a tree is one of the draft vocabulary's (heads that ignored it would guess from
    all 512), some are accepted, and the output is the base's own greedy output."""
    model = tiny_model()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, input_ids, 40)
    heads, guessed = random_heads(model), set()
    heads.config.draft_vocab = sorted(set(expected))  # guesses can be right (or wrong) only among these tokens
    guess = heads.guess

    def recorded(*args):
        best, logp = guess(*args)
        guessed.update(best.flatten().tolist())
        return best, logp

    heads.guess = recorded
    result = Decoder(model, tokenizer, heads, TREE).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == expected
    assert guessed and guessed <= set(expected) and result.tau > 1


def test_without_heads_the_loop_is_plain_greedy_decoding(tokenizer):
    model = tiny_model()
    result = Decoder(model, tokenizer).generate(PROMPT, max_new_tokens=20)
    assert result.token_ids == reference(model, tokenizer(PROMPT, return_tensors="pt").input_ids, 20)
    assert result.acceptance.lengths == [1] * 19 and result.forward_passes == 19


@pytest.mark.parametrize("grouped", [False, True], ids=["keys-repeated", "keys-grouped"])
def test_tree_attention_equals_causal_attention_along_every_path(tokenizer, grouped):
    """With transformers' copies of grouped-query keys per group, and with SDPA taking the groups as they are (the
    decoder's verification pass on a CPU, `mtp.decoding.cache.grouped_keys`)."""
    model = tiny_model()  # 4 query heads, 2 key-value heads
    prefix = tokenizer(PROMPT, return_tensors="pt").input_ids  # (1, P)
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (TREE.size,))  # any token at any node
    cache = DynamicCache()
    with torch.no_grad():
        model(prefix, cache=cache, use_cache=True)
        mask = torch.zeros(TREE.size, prefix.shape[1] + TREE.size)
        mask[:, prefix.shape[1] :].masked_fill_(~TREE.mask, torch.finfo(torch.float32).min)
        with grouped_keys(grouped):
            tree_logits = model(
                tokens[None],
                cache=cache,
                attention_mask=mask[None, None],
                position_ids=(prefix.shape[1] + TREE.depths)[None],
            ).logits[0]  # (N+1, V)
        for path in TREE.retrieve:
            nodes = path[path >= 0]
            causal = model(torch.cat([prefix[0], tokens[nodes]])[None]).logits[0, prefix.shape[1] :]  # (len, V)
            torch.testing.assert_close(tree_logits[nodes], causal, atol=1e-5, rtol=1e-4)


def test_the_cache_after_acceptance_equals_a_causal_run(tokenizer):
    model = tiny_model()
    prefix = tokenizer(PROMPT, return_tensors="pt").input_ids
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (TREE.size,))
    nodes = TREE.retrieve[-1][TREE.retrieve[-1] >= 0][:3]  # root, then two accepted candidates on the deepest path
    cache, causal = DynamicCache(), DynamicCache()
    with torch.no_grad():
        model(prefix, cache=cache, use_cache=True)
        mask = torch.zeros(TREE.size, prefix.shape[1] + TREE.size)
        mask[:, prefix.shape[1] :].masked_fill_(~TREE.mask, torch.finfo(torch.float32).min)
        model(
            tokens[None],
            cache=cache,
            attention_mask=mask[None, None],
            position_ids=(prefix.shape[1] + TREE.depths)[None],
        )
        keep_accepted(cache, torch.arange(prefix.shape[1])[None], [nodes], torch.tensor([prefix.shape[1]]))
        model(torch.cat([prefix[0], tokens[nodes]])[None], cache=causal, use_cache=True)
    assert cache.get_seq_length() == causal.get_seq_length() == prefix.shape[1] + 3
    for ours, theirs in zip(cache.layers, causal.layers, strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("head_type", Drafter.kinds)
def test_trained_heads_give_the_base_models_greedy_output(tokenizer, tmp_path, head_type):
    import lightning as L

    from mtp.training.data import DrafterDataModule
    from mtp.training.module import DrafterModule
    from mtp.training.settings import DrafterSettings, Optim
    from tests.conftest import TINY_CHAT

    module = DrafterModule(
        TINY_BASE, drafter=DrafterSettings(num_heads=4, lm_head="own", head_type=head_type), optim=Optim(lr=3e-3)
    )
    trainer = L.Trainer(
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=8))
    model = module.base_model
    model.generation_config.eos_token_id = None  # no early stop on either side
    decoder = Decoder(model, tokenizer, module.drafter.eval(), TREE)
    chats = [
        [{"role": "user", "content": question}]
        for question in ("Count from 3 to 20.", "Hi", "List 9 days of the week starting with Monday.")
    ]
    expected = [reference(model, decoder.encode(messages), 32) for messages in chats]
    for messages, tokens in zip(chats, expected, strict=True):
        result = decoder.generate(messages, max_new_tokens=32)
        assert result.token_ids == tokens
        assert result.tau > 1.5  # the trained heads are right often (random ones, as in the test above, near never)
    batched = decoder.generate(chats, max_new_tokens=32, batch_size=2)  # rows of different lengths, one joining late
    assert [result.token_ids for result in batched] == expected


@pytest.mark.slow
def test_the_packaged_smollm2_decodes_mt_bench_exactly_as_its_own_greedy_search():
    import json

    from mtp.base import DEFAULT_BASE, load_base
    from tests.conftest import DATA

    model, tokenizer = load_base(DEFAULT_BASE)
    model.generation_config.eos_token_id = None  # EOS off: both sides run the full 64 tokens
    questions = [json.loads(line) for line in (DATA / "mt_bench.jsonl").read_text().splitlines()]
    fresh = MedusaHeads(DrafterConfig(num_heads=4, hidden_size=576, vocab_size=49152))  # predicts like the lm_head
    for question in questions[::16]:  # 5 questions, one from every other category
        messages = [{"role": "user", "content": question["turns"][0]}]
        decoder = Decoder(model, tokenizer, fresh, TREE)
        input_ids = decoder.encode(messages)
        expected = reference(model, input_ids, 64)
        assert decoder.generate(messages, max_new_tokens=64).token_ids == expected
        oracle = OracleHeads(model, torch.cat([input_ids[0], torch.tensor(expected)]), num_heads=4)
        result = Decoder(model, tokenizer, oracle, TREE).generate(messages, max_new_tokens=64)
        assert result.token_ids == expected and result.tau > 3


@pytest.mark.slow
def test_the_shipped_heads_decode_the_first_mt_bench_question_as_plain_greedy_does():
    import json

    import mtp
    from mtp.decoding.sampling import GREEDY
    from mtp.tools.bench import timed_generate
    from tests.conftest import DATA, ROOT

    shipped = str(ROOT / "heads" / "smollm2-135m-instruct")
    saved = json.loads((ROOT / "heads" / "smollm2-135m-instruct" / "config.json").read_text())["acceptance"]
    assert {row["size"] for row in saved} >= {1, 2, 3, 4}  # what load paces among (tests/test_pacing.py)
    decoder = mtp.load(shipped, tree="3")  # the root and head 0's two best guesses, grown from the calibration
    assert decoder.tree.size == 3 and decoder.drafter.config.calibration is not None
    question = json.loads((DATA / "mt_bench.jsonl").read_text().splitlines()[0])["turns"][0]
    messages = [{"role": "user", "content": question}]
    result = decoder.generate(messages, max_new_tokens=128)
    (expected,), _ = timed_generate(decoder.base_model, [decoder.encode(messages)], 128, GREEDY)  # plain, EOS cut
    assert result.token_ids == expected and max(result.acceptance.lengths) > 1  # some guesses were accepted


def test_the_grouped_keys_switch_holds_for_the_verification_pass_only(monkeypatch):
    monkeypatch.delenv(GQA_SWITCH, raising=False)
    with grouped_keys(True):
        assert os.environ[GQA_SWITCH] == "1"
    assert GQA_SWITCH not in os.environ
    monkeypatch.setenv(GQA_SWITCH, "0")  # the caller's own setting comes back
    with grouped_keys(True):
        assert os.environ[GQA_SWITCH] == "1"
    assert os.environ[GQA_SWITCH] == "0"
    with grouped_keys(False):  # off (not a CPU, or one query): left alone
        assert os.environ[GQA_SWITCH] == "0"


# Families whose own forward scales lm_head's logits, each by its config
LOGIT_SCALES = {
    "granite": {"logits_scaling": 4.0},  # divides
    "hyperclovax": {"logits_scaling": 4.0},  # multiplies, by the attribute of the same name
    "cohere": {"logit_scale": 0.25},
}


@pytest.mark.parametrize("model_type", LOGIT_SCALES)
def test_the_verified_logits_are_the_models_own_scaled_logits(model_type, tokenizer):
    model = tiny_model(model_type, **LOGIT_SCALES[model_type])
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    decoder = Decoder(model, tokenizer, random_heads(model), TREE)
    with torch.no_grad():
        hidden = decoder.target.backbone(input_ids=input_ids).last_hidden_state
        ours, unscaled = decoder.target.logits(hidden), model.lm_head(hidden)
    assert torch.equal(ours, model(input_ids).logits) and not torch.allclose(ours, unscaled)
    assert decoder.generate(PROMPT, max_new_tokens=30).token_ids == reference(model, input_ids, 30)


def test_a_model_whose_forward_makes_its_logits_otherwise_is_refused(tokenizer):
    model = tiny_model()
    forward = model.forward
    model.forward = lambda **inputs: types.SimpleNamespace(logits=3 * forward(**inputs).logits)  # a scale unnamed
    with pytest.raises(ValueError, match="llama's own forward makes logits that are not its lm_head's output"):
        Decoder(model, tokenizer)
