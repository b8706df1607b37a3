"""Bases whose linear layers keep their weights in blocks (mtp.quantized): the kernel multiplies by exactly the
weights the blocks hold, a GGUF file's blocks map onto them bit for bit, and decoding a quantized base is lossless
(greedy equals its own plain greedy decoding, alone and in batches)."""

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from torch import nn

import mtp
from mtp.base import DEFAULT_BASE, gguf_file, load_base, load_tokenizer
from mtp.decoding.decoder import Decoder
from mtp.quantized import BlockLinear, blocks_of, file_blocks, kernels, quantize
from tests.conftest import PROMPT, ROOT, TINY_BASE, TREE, random_heads, reference, tiny_model

KINDS = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


def layer(bits: int, out_features=96, in_features=160, seed=0) -> tuple[nn.Linear, BlockLinear]:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features)
    return linear, BlockLinear.made_from(linear, bits)


def test_the_kernels_are_built_on_this_machine():
    assert torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or kernels()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33])
def test_the_kernel_multiplies_by_the_weights_the_blocks_hold(bits, rows):
    linear, blocks = layer(bits)
    x = torch.randn(rows, blocks.in_features)
    expected = x @ blocks.unpacked().T + linear.bias  # (rows, out)
    if kernels():
        args = (blocks.q, blocks.scale) + ((blocks.minimum,) if bits == 4 else ())
        product = getattr(torch.ops.mtp, f"q{bits}_mm")(x, *args)
        torch.testing.assert_close(product + linear.bias, expected, rtol=0, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(blocks(x[None]), expected[None], rtol=0, atol=1e-5)
        torch.testing.assert_close(blocks(x[None]), linear(x[None]), rtol=0, atol=0.2)  # (a coarse copy of it)


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_keep_each_weight_within_half_a_step(bits):
    linear, blocks = layer(bits)
    error = (blocks.unpacked() - linear.weight).abs().reshape(blocks.out_features, -1, 32)  # (N, K/32, 32)
    assert torch.all(error <= blocks.scale[..., None] * 0.5001)
    assert error.amax() > 0  # (a quantization, not a copy)


def test_the_float_weight_drafters_read_is_unpacked_once_and_kept():
    _, blocks = layer(4)
    assert blocks.weight is blocks.weight and torch.equal(blocks.weight, blocks.unpacked())


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_a_gguf_files_blocks_unpack_bit_for_bit_as_gguf_unpacks_them(kind):
    values = np.random.default_rng(0).normal(size=(48, 128)).astype(np.float32)
    values[3] = 0  # a block of zeros (scale 0)
    raw = quants.quantize(values, kind)
    q, scale, minimum = file_blocks(raw, kind)
    blocks = BlockLinear(q, scale, minimum)
    assert blocks.bits == (8 if kind == gguf.GGMLQuantizationType.Q8_0 else 4)
    assert torch.equal(blocks.unpacked(), torch.from_numpy(quants.dequantize(raw, kind)))
    x = torch.randn(3, 128)
    torch.testing.assert_close(blocks(x), x @ torch.from_numpy(quants.dequantize(raw, kind)).T, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_the_packaged_default_keeps_its_files_own_blocks():
    """Every linear layer of SmolLM2 as the Q4_1 file holds it (the lm_head as its Q8_0 embedding, tied): the blocks
    unpack to exactly the float model's weights, which are the file's unpacked."""
    float_model, _ = load_base(fast=False)
    model, _ = load_base(fast=False, weights="gguf")
    layers = {name: module for name, module in model.named_modules() if isinstance(module, BlockLinear)}
    assert len(layers) == 7 * model.config.num_hidden_layers + 1
    assert blocks_of(model).startswith("blocks: 210 4-bit, 1 8-bit, kernel ")
    assert not any(type(module) is nn.Linear for module in model.modules())
    for name, blocks in layers.items():
        assert torch.equal(blocks.unpacked(), float_model.get_submodule(name).weight), name
    assert model.lm_head.weight is model.get_input_embeddings().weight  # drafters read the tied rows
    reader = gguf.GGUFReader(gguf_file(DEFAULT_BASE))  # and against gguf's own unpacking, one layer
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    unpacked = torch.from_numpy(quants.dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(model.model.layers[0].mlp.down_proj.unpacked(), unpacked)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("head_type", ["medusa", "hydra", "eagle"])
def test_greedy_over_quantized_weights_equals_their_plain_greedy(weights, head_type, tokenizer):
    model = quantize(tiny_model(), weights)
    assert blocks_of(model).startswith(f"blocks: {15 * (weights == 'int4')} 4-bit, {15 * (weights == 'int8')} 8-bit")
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    heads = random_heads(model, head_type=head_type)
    result = Decoder(model, tokenizer, heads, TREE).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == reference(model, input_ids, 40)
    with torch.no_grad():  # (a model of its own: not the float one's logits)
        assert not torch.allclose(model(input_ids).logits, tiny_model()(input_ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_each_row_of_a_batch_over_quantized_weights_is_its_prompt_decoded_alone(weights, tokenizer):
    model = quantize(tiny_model(), weights)
    prompts = [PROMPT, "Once upon a time", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
    decoder = Decoder(model, tokenizer, random_heads(model), TREE)
    together = decoder.generate(prompts, max_new_tokens=30, batch_size=3)  # 3 rows of 10 nodes a pass
    for prompt, result in zip(prompts, together, strict=True):
        assert result.token_ids == reference(model, tokenizer(prompt, return_tensors="pt").input_ids, 30)


@pytest.mark.slow
def test_the_shipped_heads_over_the_files_own_blocks_decode_as_their_plain_greedy():
    decoder = mtp.load(str(ROOT / "heads" / "smollm2-135m-instruct"), weights="gguf", tree="8")
    messages = [{"role": "user", "content": "Name three primary colours."}]
    result = decoder.generate(messages, max_new_tokens=32)
    plain = Decoder(decoder.base_model, decoder.tokenizer).generate(messages, max_new_tokens=32)
    assert result.token_ids == plain.token_ids and result.tau > 1


def test_bad_weights_are_clear_errors():
    with pytest.raises(ValueError, match="weights='int3': choose one of float, int8, int4, gguf"):
        load_base(TINY_BASE, weights="int3")
    with pytest.raises(ValueError, match="keeps a GGUF file's own blocks"):
        load_base(TINY_BASE, weights="gguf")
