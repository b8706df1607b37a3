import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from mtp import linears
from mtp.base import load_base
from mtp.decoding.tree import Tree
from mtp.drafters import heads as heads_module
from mtp.drafters.contract import Drafter, DrafterConfig, base_identity
from mtp.drafters.heads import HydraHeads, MedusaHeads
from mtp.linears import ROWS, narrow_product, proposing, usual_linears
from tests.conftest import TINY_BASE, head_logits


@pytest.fixture
def config(tiny):
    model, tokenizer = tiny
    return DrafterConfig(num_heads=3, num_layers=2, **base_identity(TINY_BASE, model, tokenizer))


@pytest.mark.parametrize("kind", [MedusaHeads, HydraHeads])
@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_new_heads_predict_what_the_base_lm_head_predicts(tiny, config, lm_head, kind):
    model, _ = tiny
    config.lm_head = lm_head
    lm_head_module = model.get_output_embeddings()
    heads = kind(config, lm_head_module.weight.detach())
    hidden = torch.randn(2, 5, config.hidden_size)
    following = torch.randn(2, 5, 3, config.hidden_size)  # what Hydra heads read beside it: ignored at first
    logits = heads(hidden, lm_head_module, following=following)  # (K, B, T, V)
    assert logits.shape == (3, 2, 5, config.vocab_size)
    for k in range(3):
        assert torch.allclose(logits[k], lm_head_module(hidden), atol=1e-5)


def random_heads(tiny, config, lm_head, kind=MedusaHeads):
    """(model, heads with random weights: heads that differ from each other and from the base lm_head)."""
    model, _ = tiny
    config.lm_head, config.head_type = lm_head, "hydra" if kind is HydraHeads else "medusa"
    heads = kind(config, model.get_output_embeddings().weight.detach())
    torch.manual_seed(0)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return model, heads


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_guesses_from_a_draft_vocabulary_are_its_best_tokens_by_the_full_logits(tiny, config, lm_head):
    """Each head's top-k from a draft vocabulary: the full logits' best draft tokens, with their log-probabilities
    over the draft vocabulary alone (what a dynamic tree ranks nodes by)."""
    model, heads = random_heads(tiny, config, lm_head)
    hidden, lm_head_module = torch.randn(config.hidden_size), model.get_output_embeddings()
    full = heads(hidden, lm_head_module)[:2]  # (2, V)
    heads.config.draft_vocab = torch.randperm(config.vocab_size)[:40].tolist()
    outside = torch.ones(config.vocab_size, dtype=torch.bool)
    outside[heads.config.draft_vocab] = False
    within = full.masked_fill(outside, float("-inf")).log_softmax(-1)  # (2, V) over the draft tokens only
    for head in range(2):
        guesses, logp = heads.guess(hidden, None, head, 5, lm_head_module)  # (5,) twice
        assert torch.equal(guesses, within[head].topk(5).indices)
        torch.testing.assert_close(logp, within[head].topk(5).values)
        assert not torch.equal(guesses, full[head].topk(5).indices)  # not what the whole vocabulary gives
    heads.config.draft_vocab = None
    guesses, logp = heads.guess(hidden, None, 1, 5, lm_head_module)
    assert torch.equal(guesses, full[1].topk(5).indices)
    torch.testing.assert_close(logp, full[1].log_softmax(-1).topk(5).values)


@pytest.mark.parametrize("lm_head", ["shared", "own"])
@pytest.mark.parametrize("narrow", [False, True])
def test_draft_logits_are_the_same_whichever_product_this_machine_measured_faster(
    tiny, config, lm_head, narrow, monkeypatch
):
    """Projecting from float rows (validation; decoding off a CPU) multiplies a step's few rows by the draft
    vocabulary's rows as W x^T where that was measured faster (`mtp.linears.narrow_rows`, here forced either way):
    the same logits as x W^T, for one row, a few rows, and all heads at once over a shared lm_head."""
    chosen = list(range(1, ROWS + 1)) if narrow else []
    monkeypatch.setattr(
        heads_module, "narrow_rows", lambda weights: {"x".join(map(str, w.shape)): chosen for w in weights}
    )
    calls = []
    monkeypatch.setattr(linears, "narrow_product", lambda x, w: calls.append(len(x)) or narrow_product(x, w))
    model, heads = random_heads(tiny, config, lm_head)
    lm_head_module = model.get_output_embeddings()
    heads.config.draft_vocab = draft = torch.randperm(config.vocab_size)[:40].tolist()
    with torch.no_grad(), usual_linears(model):  # the references as x W^T, whatever the tiny model's layers chose
        for shape in [(1,), (1, 3), (2, 2)]:
            states = torch.randn(3, *shape, config.hidden_size)  # (K, ..., H)
            if lm_head == "shared":
                torch.testing.assert_close(heads.project(states, lm_head_module), lm_head_module(states)[..., draft])
            for k in range(3):  # one head's states, as a decoding step projects them
                projection = lm_head_module if lm_head == "shared" else heads.projections[k]
                torch.testing.assert_close(
                    heads.project(states[k : k + 1], lm_head_module, k)[0], projection(states[k])[..., draft]
                )
    assert (
        calls
        == ([3, 1, 1, 1, 9, 3, 3, 3, 12, 4, 4, 4] if lm_head == "shared" else [1, 1, 1, 3, 3, 3, 4, 4, 4]) * narrow
    )


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_drafting_on_a_cpu_takes_int8_rows_within_their_rounding_of_the_float_logits(tiny, config, lm_head):
    """Drafting for decoding on a CPU (`mtp.linears.proposing`), the draft vocabulary's logits come from its rows as
    int8 (`mtp.linears.quantized_rows`, the step's rows in bfloat16): each within the bound of that rounding from the
    float logits, their typical error small beside the logits' spread, and the best guess the float one wherever the
    float logits' best two lie further apart than twice the bound. Outside it (validation), the float logits."""
    model, heads = random_heads(tiny, config, lm_head)
    lm_head_module = model.get_output_embeddings()
    heads.config.draft_vocab = draft = torch.randperm(config.vocab_size)[:40].tolist()
    states = torch.randn(3, 50, config.hidden_size)  # (K, rows, H)
    with torch.no_grad():
        for k in range(3):  # one head's states, as a decoding step projects them
            weight = (lm_head_module if lm_head == "shared" else heads.projections[k]).weight[draft]  # (N, H)
            exact, x = states[k] @ weight.T, states[k]  # (rows, N)
            torch.testing.assert_close(heads.project(states[k : k + 1], lm_head_module, k)[0], exact)
            with proposing():
                int8 = heads.project(states[k : k + 1], lm_head_module, k)[0]
            scales = weight.abs().amax(1) / 127  # (N,) half a scale: an int8 weight's rounding
            bound = x.abs() @ (weight.abs() / 128 + scales[:, None] / 2).T + exact.abs() / 64  # (rows, N)
            assert heads._quantized is not None and ((int8 - exact).abs() <= bound).all()
            assert (int8 - exact).pow(2).mean().sqrt() < 0.02 * exact.std()  # about 0.6% here
            best, apart = exact.topk(2).values.T
            clear = best - apart > 2 * bound.amax(1)
            assert clear.sum() >= 10 and torch.equal(int8.argmax(1)[clear], exact.argmax(1)[clear])


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_training_logits_over_a_draft_vocabulary_are_the_full_logits_draft_columns_and_carry_gradients(
    tiny, config, lm_head
):
    model, heads = random_heads(tiny, config, lm_head)
    hidden, lm_head_module = torch.randn(2, 5, config.hidden_size), model.get_output_embeddings()
    input_ids, keep = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)
    full = heads(hidden, lm_head_module).flatten(1, 2)  # (3, 10, V)

    def draft():  # the training call: (3, 10, size)
        states = heads.teacher_forced(hidden, None, input_ids, keep, model.get_input_embeddings())  # (3, 10, H)
        return heads.project(states, lm_head_module)

    with torch.no_grad():  # validation: the rows are gathered once and kept
        for size in (40, 60):  # a second list on the same heads: the cached rows of the first must not serve it
            heads.config.draft_vocab = torch.randperm(config.vocab_size)[:size].tolist()
            torch.testing.assert_close(draft(), full[..., heads.config.draft_vocab])
    logits = draft()  # training: in the autograd graph
    torch.testing.assert_close(logits, full[..., heads.config.draft_vocab])
    logits.sum().backward()
    trained = [heads.blocks[0][0].linear.weight] + ([] if lm_head == "shared" else [heads.projections[0].weight])
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in trained)


@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_hydra_heads_fill_each_node_with_the_guess_for_its_own_path(tiny, config, lm_head, draft, float_drafts):
    """Level by level, batched over the parents of each depth, equals computing every node alone: node
    (r1, .., rd) holds rank rd of head d-1 reading the tokens of its parent's path (root first)."""
    model, heads = random_heads(tiny, config, lm_head, HydraHeads)
    if draft:
        heads.config.draft_vocab = torch.randperm(config.vocab_size)[:100].tolist()
    lm_head_module = model.get_output_embeddings()
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)  # N(0, 1): the path weighs as much as hidden
    tree = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (1, 0, 0), (0, 1, 0)])
    hidden, root = torch.randn(config.hidden_size), torch.tensor([7])
    proposer = heads.proposer(types.SimpleNamespace(lm_head=lm_head_module, embed=embed), {})
    proposer.hidden = [hidden]  # the row's hidden state at the root's parent
    with torch.no_grad():
        tokens = proposer.tokens(tree, root[None])[0]  # (N+1,)
        assert tokens.shape == (tree.size,) and tokens[0] == 7
        for node, path in enumerate(tree.paths, 1):
            ancestors = tree.mask[tree.parents[node]].nonzero()[:, 0]  # root .. parent
            following = embed(tokens[ancestors])  # (d, H)
            logits = head_logits(heads, len(path) - 1, hidden, lm_head_module, following)  # (V,)
            if draft:  # only draft tokens can be guessed
                logits = logits.masked_fill(
                    ~torch.isin(torch.arange(config.vocab_size), root.new_tensor(heads.config.draft_vocab)),
                    float("-inf"),
                )
            assert tokens[node] == logits.topk(3).indices[path[-1]], path
        # the path matters: the children of (0,) and (1,) are guesses of the same head after different tokens
        after = [
            head_logits(heads, 1, hidden, lm_head_module, embed(torch.stack([root[0], tokens[node]])))
            for node in (1, 2)
        ]
        assert tokens[1] != tokens[2] and not torch.allclose(*after)


def test_hydra_heads_round_trip_and_refuse_to_run_without_the_path(tiny, config, tmp_path):
    model, heads = random_heads(tiny, config, "shared", HydraHeads)
    heads.save_pretrained(tmp_path)
    loaded = Drafter.from_pretrained(tmp_path)
    hidden, following = torch.randn(4, config.hidden_size), torch.randn(4, 3, config.hidden_size)
    assert isinstance(loaded, HydraHeads)
    assert torch.equal(
        loaded(hidden, model.get_output_embeddings(), following=following),
        heads(hidden, model.get_output_embeddings(), following=following),
    )
    with pytest.raises(ValueError, match="Hydra head 2 reads the embeddings of the 3 tokens"):
        heads(hidden, model.get_output_embeddings(), following=following[:, :2])


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
    heads.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)  # half the bytes, the weights rounded once
    halved = MedusaHeads.from_pretrained(tmp_path / "bf16")
    size = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert size < 0.55 * (tmp_path / "model.safetensors").stat().st_size
    for (name, a), (_, b) in zip(heads.state_dict().items(), halved.state_dict().items(), strict=True):
        assert b.dtype == torch.float32 and torch.equal(a.to(torch.bfloat16).float(), b), name


def test_heads_larger_than_a_part_are_written_in_parts_and_load_back_whole(tiny, config, tmp_path, monkeypatch):
    import mtp.drafters.contract

    model, _ = tiny
    heads = MedusaHeads(config, model.get_output_embeddings().weight.detach())
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter)
    heads.save_pretrained(tmp_path)  # one file first: rewriting in parts must not leave it behind
    monkeypatch.setattr(mtp.drafters.contract, "SHARD_BYTES", 20_000)  # each block's weight (64 x 64 floats) is 16 kB
    heads.save_pretrained(tmp_path)
    parts = sorted(p.name for p in tmp_path.glob("model*.safetensors"))
    assert len(parts) == 6 and parts[0] == "model-00001-of-00006.safetensors"
    loaded = MedusaHeads.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


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
    [
        (dict(num_heads=0), "num_heads=0"),
        (dict(num_layers=0), "num_layers=0"),
        (dict(lm_head="tied"), "'shared'"),
        (dict(head_type="eaglet"), r"head_type='eaglet': choose one of \['eagle', 'hydra', 'medusa'\]"),
    ],
)
def test_bad_head_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        DrafterConfig(**bad)


def test_loading_from_a_folder_without_heads_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        MedusaHeads.from_pretrained(tmp_path)
