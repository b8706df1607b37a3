"""The product a linear layer takes for a few rows: measured per machine, equal to the usual one up to rounding,
and decoding exact whichever path each row count takes."""

import time
import types

import pytest
import torch
from torch.nn import functional as F

from mtp import linears
from mtp.base import load_base, load_tokenizer
from mtp.decoding.decoder import Decoder
from mtp.linears import ROWS, draft_linear, fast_linears, narrow_product, narrow_rows, proposing, usual_linears
from tests.conftest import PROMPT, TINY_BASE, TREE, random_heads, reference, tiny_model


@pytest.mark.parametrize("rows", [1, 2, 5, ROWS])
def test_the_narrow_product_equals_the_usual_one_up_to_rounding(rows):
    weight, x = torch.randn(96, 64), torch.randn(rows, 64)
    torch.testing.assert_close(narrow_product(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert narrow_product(x, weight).shape == (rows, 96)


def chosen(monkeypatch, rows):
    """Pretend the measurement chose the narrow path for `rows` for every shape."""
    monkeypatch.setattr(linears, "narrow_rows", lambda weights: {linears._shape(w): list(rows) for w in weights})


def test_a_layer_takes_the_narrow_path_exactly_for_the_chosen_row_counts(monkeypatch):
    chosen(monkeypatch, [1, 3])
    layer = torch.nn.Linear(64, 96)
    inputs = {rows: torch.randn(1, rows, 64) for rows in (1, 2, 3, ROWS + 1)}
    assert fast_linears(layer) == {"96x64": [1, 3]}
    with torch.no_grad():
        for rows, x in inputs.items():
            usual = F.linear(x, layer.weight, layer.bias)
            narrow = narrow_product(x[0], layer.weight)[None] + layer.bias
            assert torch.equal(layer(x), narrow if rows in (1, 3) else usual), rows
        with usual_linears(layer):  # plain decoding as users run it: the usual path, whatever was chosen
            assert torch.equal(layer(inputs[1]), F.linear(inputs[1], layer.weight, layer.bias))
        assert torch.equal(layer(inputs[1]), narrow_product(inputs[1][0], layer.weight)[None] + layer.bias)
    assert torch.equal(layer(inputs[1]), F.linear(inputs[1], layer.weight, layer.bias))  # training: usual, with grad
    assert layer(inputs[1]).requires_grad


def test_decoding_is_exact_with_the_narrow_path_at_every_row_count(monkeypatch):
    """Plain greedy generate (one row per step) and tree steps (several rows) all on the narrow path."""
    chosen(monkeypatch, range(1, ROWS + 1))
    model = tiny_model()
    fast_linears(model)
    heads = random_heads(model)
    fast_linears(heads)
    tokenizer = load_tokenizer(TINY_BASE)
    result = Decoder(model, tokenizer, heads, TREE).generate(PROMPT, max_new_tokens=40)
    with usual_linears(model):
        expected = reference(model, tokenizer(PROMPT, return_tensors="pt").input_ids, 40)
    assert result.token_ids == expected


def test_the_choice_is_the_faster_path_measured_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    weights = [torch.randn(32, 16)] * 2 + [torch.randn(8, 16)]
    calls = []

    def slow(x, weight):  # a product that always loses
        calls.append(len(x))
        time.sleep(1e-4)

    monkeypatch.setattr(linears, "narrow_product", slow)
    assert narrow_rows(weights) == {"32x16": [], "8x16": []}
    measured = len(calls)
    assert measured == 3 * ROWS * len(weights)  # three rounds of every row count over every weight
    assert narrow_rows(weights) == {"32x16": [], "8x16": []} and len(calls) == measured  # cached: not measured again
    monkeypatch.setattr(linears, "F", types.SimpleNamespace(linear=slow))  # now the usual path loses
    monkeypatch.setattr(linears, "narrow_product", lambda x, weight: x)
    assert narrow_rows([torch.randn(4, 16)]) == {"4x16": list(range(1, ROWS + 1))}  # other shapes: measured anew


def test_load_base_gives_every_linear_layer_the_measured_choice_and_training_the_usual_one():
    model, _ = load_base(TINY_BASE)
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    choice = narrow_rows([layer.weight for layer in layers])  # cached: what load_base measured
    assert layers and all(layer.narrow_rows == set(choice[linears._shape(layer.weight)]) for layer in layers)
    trained, _ = load_base(TINY_BASE, fast=False)
    assert not any("forward" in vars(m) for m in trained.modules())


def test_a_drafters_small_layer_drafts_from_int8_rows_kept_until_its_weight_changes():
    """Proposing (`proposing`) on a CPU without gradients, `draft_linear` multiplies by the layer's weight as int8 rows,
    within their rounding of the float product; outside it (training, validation) the layer's own float product.
    The int8 rows are made once per weight: a step of training makes them again."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 32), torch.randn(3, 64)
    with torch.no_grad():
        exact = layer(x)
        assert torch.equal(draft_linear(layer, x), exact)  # not drafting
        with proposing():
            int8, kept = draft_linear(layer, x), layer._int8
            assert draft_linear(layer, x) is not None and layer._int8 is kept  # made once
        scales = layer.weight.abs().amax(1) / 127  # half a scale: an int8 weight's rounding; x in bfloat16
        bound = x.abs() @ (layer.weight.abs() / 128 + scales[:, None] / 2).T + (exact - layer.bias).abs() / 64
        assert not torch.equal(int8, exact) and ((int8 - exact).abs() <= bound).all()
    with proposing():
        assert torch.equal(draft_linear(layer, x), exact)  # with gradients: the float product
    with torch.no_grad():
        layer.weight.mul_(2)  # as an optimizer's step writes it in place
        with proposing():
            again = draft_linear(layer, x)
        assert layer._int8 is not kept and ((again - layer(x)).abs() <= 2 * bound + 1e-6).all()
