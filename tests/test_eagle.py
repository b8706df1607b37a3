"""The feature-level drafter: its checkpoint layout, its training-time test against what decoding drafts, its cache
after acceptance against a fresh run, and its training."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from mtp.base import load_tokenizer
from mtp.decoding.decoder import Decoder
from mtp.decoding.tree import Tree
from mtp.drafters.contract import Drafter
from mtp.drafters.eagle import EagleProposer
from mtp.training.data import DrafterDataModule, collate, encode
from mtp.training.module import DrafterModule
from mtp.training.rows import read_rows, to_example
from mtp.training.settings import DrafterSettings, Loss, Optim
from tests.conftest import PROMPT, TINY_BASE, TINY_CHAT, plain_answer, random_heads, reference, tiny_model, trainer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


CHAIN = Tree.from_paths([(0,), (0, 0), (0, 0, 0)])


def test_the_parameters_are_named_and_shaped_as_eagle3_checkpoints_have_them(tmp_path):
    model = tiny_model()  # hidden 64, 4 heads of 16, 2 key-value heads, MLP 128
    drafter = random_heads(model, head_type="eagle")
    drafter.set_draft_vocab([5, 3, 9, 7], model)
    drafter.save_pretrained(tmp_path)
    shapes = {name: tuple(t.shape) for name, t in load_file(tmp_path / "model.safetensors").items()}
    assert shapes == {
        "fc.weight": (64, 2 * 64),  # two feature layers of the tiny model, fused
        "midlayer.input_layernorm.weight": (64,),
        "midlayer.hidden_norm.weight": (64,),
        "midlayer.self_attn.q_proj.weight": (64, 128),
        "midlayer.self_attn.k_proj.weight": (32, 128),
        "midlayer.self_attn.v_proj.weight": (32, 128),
        "midlayer.self_attn.o_proj.weight": (64, 64),
        "midlayer.post_attention_layernorm.weight": (64,),
        "midlayer.mlp.gate_proj.weight": (128, 64),
        "midlayer.mlp.up_proj.weight": (128, 64),
        "midlayer.mlp.down_proj.weight": (64, 128),
        "norm.weight": (64,),
        "d2t": (4,),
        "t2d": (512,),
    }
    loaded = Drafter.from_pretrained(tmp_path)
    assert (loaded.d2t + torch.arange(4)).tolist() == [3, 5, 7, 9]  # draft id i is target id i + d2t[i]
    assert loaded.t2d.nonzero()[:, 0].tolist() == [3, 5, 7, 9]
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_saved_in_bfloat16_the_draft_vocabulary_keeps_its_exact_ids(tmp_path):
    model = tiny_model()
    drafter = random_heads(model, head_type="eagle")
    drafter.set_draft_vocab([511, 257, 300, 301], model)  # offsets 257, 299, 299, 508: not all exact in bfloat16
    drafter.save_pretrained(tmp_path, dtype=torch.bfloat16)
    loaded = Drafter.from_pretrained(tmp_path)
    assert loaded.draft_ids.tolist() == [257, 300, 301, 511]
    assert loaded.t2d.nonzero()[:, 0].tolist() == [257, 300, 301, 511]
    assert load_file(tmp_path / "model.safetensors")["fc.weight"].dtype == torch.bfloat16


@torch.no_grad()
def test_decoding_drafts_along_a_chain_what_the_training_time_test_predicts():
    """Both the unrolled training pass and the decoder's level-by-level drafting: at each depth, the same guess
    (the chain of top-1 guesses follows the true tokens, as teacher forcing does, when the guesses are right)."""
    model = tiny_model()
    drafter = random_heads(model, num_heads=3, head_type="eagle")
    decoder = Decoder(model, None, drafter, CHAIN)
    ids = torch.randint(1, 512, (12,), generator=torch.Generator().manual_seed(0))
    batch = decoder.batch()
    root = batch.add(ids[None, :-1])
    out = model.get_decoder()(input_ids=torch.cat([ids[:-1], torch.tensor([root])])[None], output_hidden_states=True)
    features = torch.cat([out.hidden_states[i][0] for i in drafter.config.feature_layers], -1)  # (T, F)
    sequence = torch.cat([ids[:-1], torch.tensor([root])])
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    guesses = drafter.path_guesses(None, features, sequence, lm_head, embed, 1)  # (K, T, 1)
    proposer = batch.proposers[0]
    tree = proposer.tree(CHAIN, 3)
    tokens = proposer.tokens(tree, torch.tensor([[root]]))[0]  # (4,) root, then the chain's guesses
    # the chain's first node is guessed from the root's entry: the last true feature sits at the root's parent
    assert tokens[1] == guesses[0, -2, 0]
    # deeper ones read drafted features; teacher forcing reads the true tokens, so compare on the drafted ones
    extended = torch.cat([sequence, tokens[1:2]])
    out = model.get_decoder()(input_ids=extended[None], output_hidden_states=True)
    features = torch.cat([out.hidden_states[i][0] for i in drafter.config.feature_layers], -1)
    guesses = drafter.path_guesses(None, features, extended, lm_head, embed, 1)
    assert tokens[2] == guesses[1, -3, 0]  # step 1 at the root's parent: the token 2 past the root


@pytest.mark.parametrize("batch_size", [1, 3])
@torch.no_grad()
def test_the_drafters_cache_after_acceptance_equals_a_fresh_run_over_the_accepted_text(batch_size, tokenizer):
    model = tiny_model()
    drafter = random_heads(model, head_type="eagle")
    decoder = Decoder(model, tokenizer, drafter, Tree.from_paths([(0,), (1,), (0, 0), (0, 0, 0)]))
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in [PROMPT, "Tell me a story about", "1 2 3"]]
    batch, texts = decoder.batch(), []
    for ids in prompts[:batch_size]:
        texts.append(ids[0].tolist() + [batch.add(ids)])
    for _ in range(6):
        for text, (settled, _) in zip(texts, batch.step(), strict=True):
            text.extend(settled)
    proposer = batch.proposers[0]
    for b, text in enumerate(texts):
        fresh = EagleProposer(drafter, decoder.target, {})
        ids = torch.tensor(text[:-1])
        states = decoder.target.run(True, input_ids=ids[None])
        fresh.add(ids, states, text[-1])
        seen = proposer.seen[b]
        assert int(seen.sum()) == len(text) - 1 == proposer.positions[b]  # one entry per token after the first
        torch.testing.assert_close(proposer.keys[b][:, seen], fresh.keys[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(proposer.values[b][:, seen], fresh.values[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(proposer.state[b], fresh.state[0], atol=1e-4, rtol=1e-4)
        prompt_len = prompts[b].shape[1]
        assert text[prompt_len:] == reference(model, prompts[b], len(text) - prompt_len)  # and decoding is lossless


def test_training_moves_the_drafter_only_and_its_folder_decodes_losslessly(tmp_path, tokenizer):
    module = DrafterModule(
        TINY_BASE,
        drafter=DrafterSettings(head_type="eagle", num_heads=3, draft_vocab=100),
        loss=Loss(teacher=True),
        optim=Optim(lr=1e-2),
    )
    base_before = {name: tensor.clone() for name, tensor in module.base_model.state_dict().items()}
    drafter_before = {name: tensor.clone() for name, tensor in module.drafter.state_dict().items()}
    fit = trainer(tmp_path, max_steps=4, limit_val_batches=1)
    fit.fit(module, DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4))
    for name, tensor in module.base_model.state_dict().items():
        assert torch.equal(tensor, base_before[name]), name
    assert module.drafter.config.feature_layers == [2]  # a 2-layer base: its last layer's output
    assert len(module.drafter.config.draft_vocab) == 100 and module.drafter.config.draft_vocab == sorted(
        module.drafter.config.draft_vocab
    )
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"):
        assert not torch.equal(module.drafter.state_dict()[name], drafter_before[name]), name
    optimised = {id(p) for group in fit.optimizers[0].param_groups for p in group["params"]}
    assert optimised == {id(p) for p in module.drafter.parameters()}
    loaded = Drafter.from_pretrained(tmp_path / "heads")
    decoder = Decoder(module.base_model, tokenizer, loaded.eval(), Tree.from_paths([(0,), (1,), (0, 0)]))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    result = decoder.generate(PROMPT, max_new_tokens=20)
    expected = plain_answer(module.base_model, ids, 20, decoder.eos_ids)  # the whole answer, its length included
    assert result.token_ids == expected and (result.finish_reason == "stop") == (len(expected) < 20)


@torch.no_grad()
def test_the_feature_loss_regresses_each_steps_output_onto_the_base_state_that_scores_the_same_token(tokenizer):
    """By hand, one position at a time: step k's output at entry t + k + 1 (the one that scores token t + k + 2),
    normed, against the base model's last hidden state at t + k + 1, on assistant tokens only, weighted per step."""
    weights, scale = [1.0, 0.5], 3.0
    module = DrafterModule(
        TINY_BASE,
        drafter=DrafterSettings(head_type="eagle", num_heads=2),
        loss=Loss(weights=weights, feature_loss=scale),
    )
    torch.manual_seed(0)
    for parameter in module.drafter.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    examples = [encode(tokenizer, to_example(row), 512) for row in read_rows(TINY_CHAT)[:3]]
    embed, layers = module.base_model.get_input_embeddings(), module.drafter.config.feature_layers
    sums, counts = [0.0, 0.0], [0, 0]
    for ids, mask in examples:
        out = module.base_model.get_decoder()(input_ids=ids[None], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in layers], -1)  # (1, T, F)
        steps = module.drafter.unroll(features, ids[None], embed, 2)[:, 0]  # (K, T-1, H): entry j at index j - 1
        for k in range(2):
            for t in range(len(ids) - k - 2):
                if mask[t + k + 2]:
                    normed = module.drafter.norm(steps[k, t + k])  # entry t + k + 1
                    sums[k] += F.smooth_l1_loss(normed, out.last_hidden_state[0, t + k + 1])
                    counts[k] += 1
    expected = sum(weight * total / count for weight, total, count in zip(weights, sums, counts, strict=True))
    with_regression = module.training_step(collate(examples), 0)
    module.loss = replace(module.loss, feature_loss=0.0)
    torch.testing.assert_close(with_regression - module.training_step(collate(examples), 0), scale * expected)


@torch.no_grad()
def test_the_feature_loss_regresses_the_states_any_drafter_projects_and_takes_no_negative_weight(tokenizer):
    module = DrafterModule(
        TINY_BASE, drafter=DrafterSettings(head_type="hydra", num_heads=2), loss=Loss(feature_loss=2.0)
    )
    examples = [encode(tokenizer, to_example(row), 512) for row in read_rows(TINY_CHAT)[:2]]
    with_regression = module.training_step(collate(examples), 0)
    module.loss = replace(module.loss, feature_loss=0.0)
    assert with_regression > module.training_step(collate(examples), 0)  # new heads' states are not the base's
    with pytest.raises(ValueError, match="feature_loss=-1"):
        DrafterModule(TINY_BASE, drafter=DrafterSettings(head_type="eagle", num_heads=2), loss=Loss(feature_loss=-1.0))
