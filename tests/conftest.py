import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub; set before transformers is imported
os.environ["MTP_COMPILE"] = "0"  # mtp.load and the command lines decode eagerly here; tests/test_compiled.py compiles
if "PYTEST_XDIST_WORKER" in os.environ:  # a worker per core (scripts/test.sh): one thread each, not one per core each
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import itertools  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import types  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import mtp  # noqa: E402
from mtp.base import load_base  # noqa: E402
from mtp.decoding.decoder import Decoder  # noqa: E402
from mtp.decoding.sampling import GREEDY, Sampling  # noqa: E402
from mtp.decoding.tree import Tree  # noqa: E402
from mtp.drafters.contract import Drafter, DrafterConfig, base_identity  # noqa: E402
from mtp.drafters.heads import MedusaHeads  # noqa: E402
from mtp.quantized import quantize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_BASE = str(ROOT / "configs" / "models" / "tiny-llama" / "config.json")
TINY_CHAT = str(ROOT / "data" / "tiny_chat.jsonl")
DATA = ROOT / "data"


class Killed(L.Callback):
    """Kills its process (SIGKILL: no exception, nothing cleaned up or saved) as training step `step` starts."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def float_drafts(monkeypatch):
    """Drafters decode here from float rows, as off a CPU (`mtp.linears.uses_int8_rows`): for tests that compare their
    logits with float references."""
    from mtp import linears
    from mtp.drafters import eagle, heads

    for module in (heads, eagle, linears):
        monkeypatch.setattr(module, "uses_int8_rows", lambda device: False)


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the randomly initialised tiny Llama."""
    return load_base(TINY_BASE)


# Tiny random models, their greedy reference and drafters for them (tree decoding is lossless)
PROMPT = "Count from 3 to 40: 3, 4, 5, 6,"
TREE = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)])


def tiny_model(model_type="llama", eos=None, seed=0, **overrides):
    """A random 2-layer model of `model_type` over the tiny tokenizer; eos=None so runs cannot stop early."""
    config = AutoConfig.for_model(
        model_type,
        **{
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "eos_token_id": eos,
            "bos_token_id": None,
            "pad_token_id": 0,
            **overrides,
        },
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = eos
    return model


def reference(model, input_ids, max_new_tokens):
    """The base model's own greedy continuation (min_new_tokens: no early stop whatever the config says; an
    explicit attention mask, else generate masks prompt tokens equal to the pad token, <|im_end|> in ChatML)."""
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, input_ids.shape[1] :].tolist()


def plain_answer(model, input_ids, max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """What plain greedy decoding answers: the base model's greedy tokens before its first EOS, at most
    max_new_tokens of them (a decoder's `token_ids` keep no EOS)."""
    tokens = reference(model, input_ids, max_new_tokens)
    return next((tokens[:i] for i, token in enumerate(tokens) if token in eos_ids), tokens)


class OracleHeads(MedusaHeads):
    """Heads that know the future: they look up which position of which reference causal run (one per prompt) the
    given hidden state belongs to and put all their mass on the true tokens t+2 .. t+K+1 (laid out on the tree as
    Medusa heads')."""

    def __init__(self, model, sequence: torch.Tensor | list[torch.Tensor], num_heads: int):
        nn.Module.__init__(self)  # no weights: the guesses come from the reference runs
        self.sequences = [sequence] if isinstance(sequence, torch.Tensor) else sequence
        with torch.no_grad():
            self.hidden = [model.get_decoder()(input_ids=s[None]).last_hidden_state[0] for s in self.sequences]
        self.vocab, self.config = model.config.vocab_size, types.SimpleNamespace(num_heads=num_heads)

    def guess(self, hidden, following, head, k, lm_head):
        logits = torch.zeros(*hidden.shape[:-1], self.vocab)  # (B, 1, V): all but the true token equally unlikely
        for b, state in enumerate(hidden.flatten(0, -2)):  # the closest hidden state of every reference run
            run, t = min(
                (
                    (r, int(d.argmin()), float(d.min()))
                    for r, d in enumerate((h - state).abs().amax(-1) for h in self.hidden)
                ),
                key=lambda found: found[2],
            )[:2]
            if t + head + 2 < len(self.sequences[run]):
                logits.view(-1, self.vocab)[b, self.sequences[run][t + head + 2]] = 20.0
        logp, best = logits.log_softmax(-1).topk(k, dim=-1)
        return best, logp  # (B, 1, k) twice


def feature_layers(model, head_type: str) -> list[int]:
    """What a drafter of `head_type` reads of `model`: for `eagle`, every decoder layer's output."""
    return list(range(1, model.config.num_hidden_layers + 1)) if head_type == "eagle" else []


def random_heads(model, num_heads=4, seed=1, head_type="medusa"):
    torch.manual_seed(seed)
    config = DrafterConfig(
        num_heads=num_heads,
        head_type=head_type,
        hidden_size=64,
        vocab_size=model.config.vocab_size,
        feature_layers=feature_layers(model, head_type),
    )
    heads = Drafter.kinds[head_type].new(config, model)
    for parameter in heads.parameters():
        nn.init.normal_(parameter, std=0.5)
    return heads


# Sliding-window attention settings of the tiny models
WINDOW = 16
SLIDING = {
    "mistral": dict(sliding_window=WINDOW),
    "phi3": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full, 1 slides
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], head_dim=16),
    "gemma2": dict(sliding_window=WINDOW, head_dim=16),  # alternating layers, eager attention, soft caps
}


# Sampling over an 8-token vocabulary, checked against the exact joint distribution
VOCAB = 8
SMALL_VOCAB_PROMPT = torch.tensor([[3, 7, 1]])
SMALL_VOCAB_TREE = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def small_vocab_decoder(
    seed=0,
    sliding_window=None,
    head_type="medusa",
    lookup=None,
    tree=SMALL_VOCAB_TREE,
    model_type=None,
    repeat=False,
    weights=None,
    **family,
) -> Decoder:
    """A 1-layer Llama (a Mistral if `sliding_window`, else `model_type` with its `family` settings) over 8 tokens,
    peaked enough that a few continuations dominate, random heads on `tree`, and `lookup`; with `weights` ("int8",
    "int4"), 32 wide and its linear layers' weights then put in blocks (`mtp.quantized`). With `repeat`, a model
    that mostly repeats its last token (its lm_head a quarter of its embeddings) and new drafters, which guess what
    the base model predicts next, so their deepest guesses are often accepted."""
    torch.manual_seed(seed)
    window = {"sliding_window": sliding_window} if sliding_window else {}
    model_type = model_type or ("mistral" if sliding_window else "llama")
    width = 32 if weights else 16
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        **window,
        **family,
    )
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        if repeat:
            model.model.embed_tokens.weight.normal_()
            model.lm_head.weight.copy_(model.model.embed_tokens.weight / 4)
        else:
            model.lm_head.weight.mul_(60)  # sharper next-token distributions than a fresh init's near-uniform ones
    if weights:
        quantize(model, weights)
    config = DrafterConfig(
        num_heads=3,
        lm_head="own",
        head_type=head_type,
        hidden_size=width,
        vocab_size=VOCAB,
        feature_layers=feature_layers(model, head_type),
    )
    heads = Drafter.kinds[head_type].new(config, model)
    for parameter in heads.parameters() if not repeat else ():
        torch.nn.init.normal_(parameter, std=0.5)
    return Decoder(model, None, heads.eval(), tree, lookup)


def exact_joint(model, sampling: Sampling, prompt: torch.Tensor = SMALL_VOCAB_PROMPT) -> dict[tuple, float]:
    """The base model's probability of every 3-token continuation of `prompt` (1, P), by enumeration."""
    sequences = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))  # (V^2, 2)
    ids = torch.cat([prompt.expand(len(sequences), -1), sequences], 1)  # (V^2, P+2)
    with torch.no_grad():
        probs = sampling.probabilities(model(ids).logits[:, -3:])  # (V^2, 3, V) after the prompt, x1, x2
    joint = {}
    for row, (x1, x2) in enumerate(sequences.tolist()):
        for x3 in range(VOCAB):
            joint[(x1, x2, x3)] = float(probs[row, 0, x1] * probs[row, 1, x2] * probs[row, 2, x3])
    return joint


def chi_square_z(found: Counter, joint: dict[tuple, float]) -> float:
    """Pearson's chi-square of the counts against the exact joint (cells expected below 5 pooled), as a
    standard normal z by the Wilson-Hilferty approximation: z > 4 happens by chance with p < 4e-5."""
    n = sum(found.values())
    assert set(found) <= {x for x, p in joint.items() if p > 0}, "a continuation the base model cannot produce"
    big = [x for x, p in joint.items() if n * p >= 5]
    cells = [(found[x], n * joint[x]) for x in big]
    cells.append((n - sum(found[x] for x in big), n * (1 - sum(joint[x] for x in big))))
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    return ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


# Lightning training on the CPU
def trainer(tmp_path, max_steps, callbacks=(), **kwargs):
    return L.Trainer(
        max_steps=max_steps,
        default_root_dir=tmp_path,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=list(callbacks),
        **kwargs,
    )


# Random heads saved to a folder, as `mtp.load` reads them
def save_random_heads(tmp_path, lm_head="shared", head_type="medusa"):
    model, tokenizer = mtp.base.load_base(TINY_BASE)
    identity = base_identity(TINY_BASE, model, tokenizer)
    config = DrafterConfig(
        num_heads=3, lm_head=lm_head, head_type=head_type, **identity, feature_layers=feature_layers(model, head_type)
    )
    heads = Drafter.kinds[head_type].new(config, model)
    torch.manual_seed(0)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    heads.save_pretrained(tmp_path / "heads")
    return str(tmp_path / "heads"), model, tokenizer


def head_logits(heads, k: int, hidden: torch.Tensor, lm_head: nn.Module, following=None) -> torch.Tensor:
    """Head k's whole-vocabulary logits (..., V) from the heads' forward; `following` (..., k + 1, H), the path head k
    reads, padded with zeros for the heads after it."""
    if following is not None:
        following = nn.functional.pad(following, (0, 0, 0, heads.config.num_heads - following.shape[-2]))
    return heads(hidden, lm_head, following=following)[k]


def passes(decoder: Decoder, input_ids: torch.Tensor, sampling: Sampling = GREEDY):
    """Yield what each pass of `decoder` settles for the prompt input_ids (1, T), alone in a batch: the prefill's
    first token, then per step the accepted candidates and the bonus token, with how many each drafter proposed
    (by name). Runs until the caller stops."""
    batch = decoder.batch(sampling)
    yield [batch.add(input_ids)], {}
    while True:
        yield batch.step()[0]
