import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import mtp.decoding.acceptance
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import Lookup
from mtp.decoding.sampling import Sampling
from mtp.decoding.tree import DynamicTree
from tests.conftest import SMALL_VOCAB_PROMPT as PROMPT
from tests.conftest import SMALL_VOCAB_TREE as TREE
from tests.conftest import chi_square_z, exact_joint, passes, random_heads, reference, small_vocab_decoder, tiny_model


def sample(decoder: Decoder, sampling: Sampling, n: int, rows: int = 1) -> tuple[Counter, Counter]:
    """n continuations of 3 tokens, `rows` at a time in one batch (seeds sampling.seed + the batch's first
    number), and how many tokens each step settled (and, under "lookup", how many accepted candidates prompt lookup
    alone proposed). Each row draws from one generator's stream: fresh uniforms whichever row takes them."""
    found, settled = Counter(), Counter()
    for start in range(0, n, rows):
        batch = decoder.batch(replace(sampling, seed=sampling.seed + start))
        tokens = [[batch.add(PROMPT)] for _ in range(min(rows, n - start))]
        while min(len(row) for row in tokens) < 3:
            for row, (block, accepted_by) in zip(tokens, batch.step(), strict=True):
                if len(row) < 3:  # (a row done already steps on with the others, uncounted)
                    settled[len(block)] += 1
                    settled["lookup"] += accepted_by.get("lookup", 0)
                row += block
        found.update(tuple(row[:3]) for row in tokens)
    return found, settled


COHERE = {"logit_scale": 0.5, "tie_word_embeddings": False}  # untied: heads that guess well enough to be accepted
SETTINGS = [Sampling(temperature=1.0, seed=0), Sampling(temperature=0.7, top_k=6, top_p=0.9, seed=10**6)]


@pytest.mark.parametrize(
    "sampling, sliding_window, head_type, lookup, tree, model_type, family",
    [
        (SETTINGS[0], None, "medusa", None, TREE, None, {}),
        (SETTINGS[1], None, "medusa", None, TREE, None, {}),
        (Sampling(temperature=1.0, seed=2 * 10**6), 2, "medusa", None, TREE, None, {}),
        (Sampling(temperature=0.7, top_k=6, top_p=0.9, seed=3 * 10**6), None, "hydra", None, TREE, None, {}),
        (Sampling(temperature=1.0, seed=4 * 10**6), None, "medusa", Lookup((3, 3)), TREE, None, {}),
        (Sampling(temperature=1.0, seed=5 * 10**6), None, "eagle", None, TREE, None, {}),
        (Sampling(temperature=1.0, seed=6 * 10**6), None, "hydra", None, DynamicTree(5, 3, 2), None, {}),
        (Sampling(temperature=1.0, seed=7 * 10**6), None, "medusa", None, TREE, "granite", {"logits_scaling": 2.0}),
        (Sampling(temperature=1.0, seed=8 * 10**6), None, "medusa", None, TREE, "cohere", COHERE),
        (
            Sampling(temperature=0.7, top_k=6, top_p=0.9, seed=9 * 10**6),
            None,
            "hydra",
            None,
            TREE,
            None,
            {"weights": "int4"},
        ),
    ],
    # window 2: the last 3 tokens see their last 2; lookup: its candidates beside the heads', in the same tree;
    # dynamic: each step's tree chosen from the drafter's probabilities; granite (divides its logits by
    # logits_scaling), cohere (multiplies them by logit_scale): the scale is part of the distribution
    ids=[
        "t1",
        "t0.7-k6-p0.9",
        "t1-window2",
        "t0.7-k6-p0.9-hydra",
        "t1-lookup",
        "t1-eagle",
        "t1-hydra-dynamic",
        "t1-granite",
        "t1-cohere",
        "t0.7-k6-p0.9-hydra-int4",
    ],
)
@pytest.mark.slow
def test_exact_acceptance_samples_the_base_models_joint_distribution(
    sampling, sliding_window, head_type, lookup, tree, model_type, family
):
    decoder = small_vocab_decoder(
        sliding_window=sliding_window, head_type=head_type, lookup=lookup, tree=tree, model_type=model_type, **family
    )
    joint = exact_joint(decoder.base_model, sampling)
    found, settled = sample(decoder, sampling, 20_000, rows=1 if sampling is SETTINGS[0] else 50)  # t1: a lone
    # prompt's path; the others 50 rows to a batch (a third of the time, the same statistic over as many samples)
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
    found, _ = sample(decoder, sampling, 2_000, rows=50)  # z 138.8, as one row at a time
    with pytest.raises(AssertionError, match="cannot produce|chi"):
        assert chi_square_z(found, exact_joint(decoder.base_model, sampling)) < 4, "chi-square rejects"


# Every step, deep: LENGTH tokens per sample, from a drafter whose deepest guesses are often accepted
LENGTH = 12


def sample_deep(decoder: Decoder, sampling: Sampling, n: int, rows: int = 50) -> torch.Tensor:
    """n sampled continuations of PROMPT (n, LENGTH), `rows` at a time in one batch (one seed per batch)."""
    found = []
    for start in range(0, n, rows):
        batch = decoder.batch(replace(sampling, seed=sampling.seed + start))
        tokens = [[batch.add(PROMPT)] for _ in range(rows)]
        while min(len(row) for row in tokens) < LENGTH:
            for row, (block, _) in zip(tokens, batch.step(), strict=True):
                row += block
        found += [row[:LENGTH] for row in tokens]
    return torch.tensor(found)


def conditional_z(model, sampling: Sampling, samples: torch.Tensor) -> float:
    """How far the samples (n, T) stray from the base model's distribution given each one's own prefix, at every
    position: per position, S = sum over samples of (one-hot token - p), with p the processed distribution after
    that sample's prefix, and S' C^+ S (C = the sum of the p's multinomial covariances) is chi-square with rank C
    degrees of freedom, independently across positions (each token's deviation has mean 0 given all before it). The
    total as a standard normal z (Wilson-Hilferty): above 4 by chance with p < 4e-5."""
    ids = torch.cat([PROMPT.expand(len(samples), -1), samples], 1)
    with torch.no_grad():
        p = sampling.probabilities(model(ids).logits[:, PROMPT.shape[1] - 1 : -1]).double()  # (n, T, V)
    assert bool((p.gather(2, samples[..., None]) > 0).all()), "a token the base model cannot produce"
    deviation = nn.functional.one_hot(samples, p.shape[-1]).double() - p  # (n, T, V)
    statistic, df = 0.0, 0
    for t in range(samples.shape[1]):
        covariance = torch.diag(p[:, t].sum(0)) - p[:, t].T @ p[:, t]  # (V, V)
        total = deviation[:, t].sum(0)
        statistic += float(total @ torch.linalg.pinv(covariance, hermitian=True) @ total)
        df += int(torch.linalg.matrix_rank(covariance, hermitian=True))
    return ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def accept_exact_wrong_at_depth_3(tokens, children, logits, sampling, generator):
    """Exact acceptance with one bug, at depth 3 only: a rejected candidate there keeps its mass, so the bonus token
    can repeat it."""
    nodes = [0]
    p = sampling.probabilities(logits[0]).cpu()
    while True:
        for child in children[nodes[-1]]:
            x = int(tokens[child])
            if mtp.decoding.acceptance.coin(float(p[x]), generator):
                nodes.append(child)
                p = sampling.probabilities(logits[child]).cpu()
                break
            if len(nodes) < 3:
                p[x] = 0
                p /= p.sum()
        else:
            return nodes, mtp.decoding.acceptance.draw(p, generator)


DEEP = [
    (head_type, tree, lookup, None)
    for head_type in ("medusa", "hydra", "eagle")
    for tree in (TREE, DynamicTree(6, 3, 2))
    for lookup in (None, Lookup((3, 3)))
]
DEEP.append(("hydra", DynamicTree(6, 3, 2), Lookup((3, 3)), 2))  # a sliding window of 2 tokens, as a Mistral's


@pytest.mark.parametrize(
    "head_type, tree, lookup, window",
    DEEP,
    ids=[
        f"{h}-{'dynamic' if isinstance(t, DynamicTree) else 'static'}{'-lookup' if lookup else ''}"
        f"{f'-window{w}' if w else ''}"
        for h, t, lookup, w in DEEP
    ],
)
@pytest.mark.slow
def test_every_step_samples_the_base_models_distribution_and_a_rule_wrong_at_depth_3_is_caught(
    head_type, tree, lookup, window, monkeypatch
):
    """12 tokens a sample, 50 rows a batch: every position's token follows the base model's distribution given the
    sample's own prefix, over steps that accept guesses 3 deep most of the time; the same test fails an acceptance
    rule that is wrong at depth 3 alone."""
    decoder = small_vocab_decoder(head_type=head_type, lookup=lookup, tree=tree, repeat=True, sliding_window=window)
    sampling = Sampling(temperature=1.0, seed=9 * 10**6, **({} if lookup is None else {"top_k": 5, "top_p": 0.95}))
    depths = Counter()
    exact = mtp.decoding.acceptance.accept_exact

    def counted(*args):
        nodes, token = exact(*args)
        depths[len(nodes) - 1] += 1
        return nodes, token

    monkeypatch.setattr(mtp.decoding.acceptance, "accept_exact", counted)
    assert conditional_z(decoder.base_model, sampling, sample_deep(decoder, sampling, 2_000)) < 4
    assert depths[3] > depths.total() / 3  # most steps accept 3 guesses
    monkeypatch.setattr(mtp.decoding.acceptance, "accept_exact", accept_exact_wrong_at_depth_3)
    assert conditional_z(decoder.base_model, sampling, sample_deep(decoder, sampling, 2_000)) > 4


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
    for sampling in [
        Sampling(temperature=0, top_k=5, seed=3),
        Sampling(temperature=0.9, seed=1),
        Sampling(temperature=0.9, seed=1),
        Sampling(temperature=0.9, seed=2),
    ]:
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


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_settings_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**options)
