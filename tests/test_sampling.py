from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import mtp.decoding.acceptance
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import Lookup
from mtp.decoding.sampling import Sampling
from mtp.decoding.tree import DynamicTree
from tests.conftest import SMALL_VOCAB_PROMPT as PROMPT
from tests.conftest import SMALL_VOCAB_TREE as TREE
from tests.conftest import chi_square_z, exact_joint, passes, random_heads, reference, small_vocab_decoder, tiny_model


def sample(decoder: Decoder, sampling: Sampling, n: int) -> tuple[Counter, Counter]:
    """n continuations of 3 tokens (seeds sampling.seed + i), and how many tokens each step settled (and, under
    "lookup", how many accepted candidates prompt lookup alone proposed)."""
    found, settled = Counter(), Counter()
    for i in range(n):
        tokens = []
        for step, (block, accepted_by) in enumerate(passes(decoder, PROMPT, replace(sampling, seed=sampling.seed + i))):
            tokens += block
            settled[len(block)] += step > 0
            settled["lookup"] += accepted_by.get("lookup", 0)
            if len(tokens) >= 3:
                break
        found[tuple(tokens[:3])] += 1
    return found, settled


SETTINGS = [Sampling(temperature=1.0, seed=0), Sampling(temperature=0.7, top_k=6, top_p=0.9, seed=10**6)]


@pytest.mark.parametrize(
    "sampling, sliding_window, head_type, lookup, tree",
    [
        (SETTINGS[0], None, "medusa", None, TREE),
        (SETTINGS[1], None, "medusa", None, TREE),
        (Sampling(temperature=1.0, seed=2 * 10**6), 2, "medusa", None, TREE),
        (Sampling(temperature=0.7, top_k=6, top_p=0.9, seed=3 * 10**6), None, "hydra", None, TREE),
        (Sampling(temperature=1.0, seed=4 * 10**6), None, "medusa", Lookup((3, 3)), TREE),
        (Sampling(temperature=1.0, seed=5 * 10**6), None, "eagle", None, TREE),
        (Sampling(temperature=1.0, seed=6 * 10**6), None, "hydra", None, DynamicTree(5, 3, 2)),
    ],
    # window 2: the last 3 tokens see their last 2; lookup: its candidates beside the heads', in the same tree;
    # dynamic: each step's tree chosen from the drafter's probabilities
    ids=[
        "t1",
        "t0.7-k6-p0.9",
        "t1-window2",
        "t0.7-k6-p0.9-hydra",
        "t1-lookup",
        "t1-eagle",
        "t1-hydra-dynamic",
    ],
)
def test_exact_acceptance_samples_the_base_models_joint_distribution(sampling, sliding_window, head_type, lookup,
                                                                     tree):  # fmt: skip
    decoder = small_vocab_decoder(sliding_window=sliding_window, head_type=head_type, lookup=lookup, tree=tree)
    joint = exact_joint(decoder.base_model, sampling)
    found, settled = sample(decoder, sampling, 20_000)
    accepted = sum(v for k, v in settled.items() if isinstance(k, int) and k > 1)
    assert settled[1] > 1000 and accepted > 1000  # rejections and acceptances
    assert lookup is None or settled["lookup"] > 200  # lookup's own candidates were accepted (586 in 20,000 runs)
    assert chi_square_z(found, joint) < 4


def test_the_distribution_test_catches_a_rule_that_accepts_every_guess(monkeypatch):
    def accept_always(tokens, children, logits, sampling, generator):
        nodes = [0]
        while children[nodes[-1]]:
            nodes.append(children[nodes[-1]][0])
        return nodes, mtp.decoding.acceptance.draw(sampling.probabilities(logits[nodes[-1]]), generator)

    decoder, sampling = small_vocab_decoder(), SETTINGS[0]
    monkeypatch.setattr(mtp.decoding.acceptance, "accept_exact", accept_always)
    found, _ = sample(decoder, sampling, 2_000)
    with pytest.raises(AssertionError, match="cannot produce|chi"):
        assert chi_square_z(found, exact_joint(decoder.base_model, sampling)) < 4, "chi-square rejects"


def test_top_k_top_p_and_temperature_process_logits_as_plain_sampling_does():
    logits = torch.randn(64, 200, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8), (0.5, 50, 0.6), (1.0, 1, 1.0)]:
        ours = Sampling(temperature=temperature, top_k=top_k, top_p=top_p).probabilities(logits)
        hf = TemperatureLogitsWarper(temperature)(None, logits)
        hf = TopKLogitsWarper(top_k)(None, hf) if top_k else hf
        hf = TopPLogitsWarper(top_p)(None, hf) if top_p < 1 else hf
        hf = hf.softmax(-1)
        assert torch.equal(ours > 0, hf > 0), (temperature, top_k, top_p)  # the same support
        assert torch.allclose(ours, hf, atol=1e-6)
        if top_k:
            assert ((ours > 0).sum(-1) <= top_k).all()


@pytest.mark.parametrize(
    "sampling", [Sampling(temperature=0.8, top_k=3, seed=5), Sampling(temperature=1.0, top_p=0.5, seed=5)]
)
def test_every_sampled_token_is_in_the_support_that_top_k_and_top_p_leave(sampling):
    decoder = small_vocab_decoder()
    for i in range(20):
        tokens = []
        for block, _ in passes(decoder, PROMPT, replace(sampling, seed=i)):
            tokens += block
            if len(tokens) >= 12:
                break
        ids = torch.cat([PROMPT, torch.tensor([tokens])], 1)
        with torch.no_grad():
            allowed = sampling.probabilities(decoder.base_model(ids).logits[0, PROMPT.shape[1] - 1 : -1]) > 0
        assert allowed[torch.arange(len(tokens)), torch.tensor(tokens)].all()


def test_temperature_zero_is_greedy_and_a_seed_makes_a_run_reproducible():
    model = tiny_model()
    decoder = Decoder(model, None, random_heads(model), TREE)
    prompt = torch.tensor([[1, 5, 9, 4]])
    greedy = reference(model, prompt, 24)
    runs = {}
    for sampling in [Sampling(temperature=0, top_k=5, seed=3), Sampling(temperature=0.9, seed=1),
                     Sampling(temperature=0.9, seed=1), Sampling(temperature=0.9, seed=2)]:  # fmt: skip
        tokens = []
        for block, _ in passes(decoder, prompt, sampling):
            tokens += block
            if len(tokens) >= 24:
                break
        runs.setdefault(sampling.seed, []).append(tokens[:24])
    assert runs[3] == [greedy]
    assert runs[1][0] == runs[1][1] and runs[1][0] != runs[2][0]


def test_typical_acceptance_takes_likely_guesses_and_rejects_unlikely_ones():
    decoder = small_vocab_decoder()
    typical = Sampling(temperature=1.0, seed=0, acceptance="typical")
    found, settled = sample(decoder, typical, 300)
    assert sum(v for k, v in settled.items() if isinstance(k, int) and k > 1) > 0 and settled[1] > 0
    with pytest.raises(ValueError, match="acceptance='fast'"):
        Sampling(temperature=1.0, acceptance="fast")


@pytest.mark.parametrize("options, message", [(dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"),
                                              (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p")])  # fmt: skip
def test_bad_sampling_settings_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**options)
