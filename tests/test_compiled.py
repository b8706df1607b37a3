"""The compiled verification pass (mtp.decoding.compiled): the same logits as the eager pass in every bucket, the
cache after acceptance a causal run's, no compiling while decoding, greedy output plain greedy output alone and in
batches, and the ways back to eager steps (the cache's end, a second row, a tree past the largest bucket, a model
that does not compile). Compiled with ATen's products (templates=False, which compiles faster) but in one test,
which changes kernels, not what they compute."""

import json
import mmap
import struct
import sys
import threading
import types
from itertools import zip_longest
from unittest import mock

import pytest
import torch
from conftest import PROMPT, SLIDING, TINY_BASE, TREE, OracleHeads, random_heads, reference, tiny_model
from safetensors.torch import load_file
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.cpu_vec_isa import pick_vec_isa
from transformers import AutoModelForCausalLM, DynamicCache

import mtp.decoding.compiled as compiled_module
from mtp import internals
from mtp.base import load_tokenizer
from mtp.decoding import constants
from mtp.decoding.batch import Batch
from mtp.decoding.cache import tree_attention_mask
from mtp.decoding.compiled import CompiledPass, compile_pass
from mtp.decoding.decoder import Decoder, GenerationResult
from mtp.decoding.lookup import Lookup
from mtp.decoding.target import Target
from mtp.decoding.tree import Tree
from mtp.machine import device_name
from mtp.quantized import kernels, quantize

SMALL = Tree.from_paths([(0,), (1,), (0, 0)])  # 4 nodes: bucket 4; TREE (10 nodes) is past the largest bucket


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def compiled(model):
    """The tiny Llama's pass compiled for 1 and 4 nodes over 256 slots, with every layer's hidden states."""
    compiled = CompiledPass(Target(model), every_layer=True, buckets=(1, 4), length=256, templates=False)
    compiled.warm_up()
    return compiled


def prefilled(model, prompt: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    with torch.no_grad():
        model.get_decoder()(input_ids=prompt, cache=cache, use_cache=True)
    return cache


FORK = (torch.tensor([[5, 9, 7]]), torch.tensor([[0, 1, 1]]), torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]]).bool())
"""Three nodes after a prompt: tokens, positions past it, the tree's mask (a node and its two children)."""


def assert_the_eager_logits(compiled, model, prompt: torch.Tensor, tokens, positions, tree_mask) -> None:
    """The compiled pass over `tokens` after `prompt` gives the eager pass's logits."""
    positions, slots = prompt.shape[1] + positions, torch.arange(prompt.shape[1])[None]
    with torch.no_grad():
        compiled.load(prefilled(model, prompt))
        ours = compiled.run(tokens, positions, tree_mask, slots)
        mask = tree_attention_mask(tree_mask, positions, slots, compiled.target.windows, compiled.target.dtype)
        theirs = compiled.target.run(
            False, input_ids=tokens, position_ids=positions, attention_mask=mask, cache=prefilled(model, prompt)
        )
    torch.testing.assert_close(ours.logits, compiled.target.logits(theirs.last), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tree", [Tree.from_paths([]), Tree.from_paths([(0,), (1,)]), SMALL, TREE])
def test_compiled_logits_equal_the_eager_passes_in_every_bucket(model, compiled, tokenizer, tree):
    """1 node (bucket 1), 3 nodes padded to 4, 4 nodes, and 10 nodes (past the largest bucket: eager, over the
    static cache): every node's logits and hidden states those of the eager pass over a dynamic cache. The slots
    after the pass hold NaN: a pass that read them (attention over every slot, masked) would give NaN."""
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    tokens = torch.randint(0, 512, (1, tree.size), generator=torch.Generator().manual_seed(tree.size))
    positions = (prompt.shape[1] + tree.depths)[None]  # (1, Q)
    slots = torch.arange(prompt.shape[1])[None]
    target = compiled.target
    with torch.no_grad():
        for layer in compiled.load(prefilled(model, prompt)).layers:
            layer.keys[:, :, prompt.shape[1] :], layer.values[:, :, prompt.shape[1] :] = torch.nan, torch.nan
        ours = compiled.run(tokens, positions, tree.mask[None], slots, every_layer=True)
        cache = prefilled(model, prompt)
        mask = tree_attention_mask(tree.mask[None], positions, slots, target.windows, target.dtype)
        theirs = target.run(True, input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache)
    torch.testing.assert_close(ours.logits, target.logits(theirs.last), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.last, theirs.last, atol=1e-5, rtol=1e-4)
    assert len(ours.layers) == len(theirs.layers) == model.config.num_hidden_layers + 1
    assert int(compiled.cache.get_seq_length()) == prompt.shape[1] + (compiled.bucket(tree.size) or tree.size)


@pytest.mark.slow
@pytest.mark.parametrize("attention, bucket", [("sdpa", 4), ("eager", 8)])
def test_the_cpp_gemm_templates_a_cpu_compiles_by_default_give_the_eager_logits(
    attention, bucket, tokenizer, monkeypatch, tmp_path
):
    """The pass as mtp compiles it on a CPU by default (in float32 each product inductor's C++ GEMM template, its
    weight packed into the template's blocks), 3 nodes padded to 4 or to 8 (on AVX2, 8 rows at once): every node's
    logits those of the eager pass. Attention written as products of activations (eager), which no template
    computes, compiles too."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))  # compiled here (a package's key holds no attention's kind)
    model = tiny_model(seed=2, attn_implementation=attention)
    compiled = CompiledPass(Target(model), buckets=(bucket,), length=64)
    assert_the_eager_logits(compiled, model, tokenizer(PROMPT, return_tensors="pt").input_ids, *FORK)
    # the package holds no weights: each constant it reads is one of the model's tensors in place, or a linear
    # layer's weight in the template's blocks, made at load; a decoder layer's linear whose weight it reads in blocks
    # alone then holds its weight in those blocks (the rest, read as ATen's products read them, keep theirs)
    recipes = json.loads(compiled._package_path().with_suffix(".json").read_text())
    assert load_file(str(compiled._package_path().with_suffix(".safetensors"))) == {}
    tensors, forms = compiled._tensors, {}
    for constant, (name, form, _) in recipes.items():
        if constant not in compiled._constants:  # recorded while compiling, not read by the package
            continue
        value, forms[name] = compiled._constants[constant], forms.get(name, set()) | {form}
        if form == "blocked":
            own = tensors.get(name.removesuffix("weight") + "blocks")
            assert (
                value is own
                if own is not None
                else torch.equal(value, constants.blocked(tensors[name], value.shape[2]))
            )
        else:
            assert value.data_ptr() == tensors[name].data_ptr()
    layers = list(compiled._forward.backbone.named_modules())
    held = {name for name, m in layers if isinstance(m, constants.PanelLinear)}
    only_blocked = {name for name, read in forms.items() if read == {"blocked"} and name.startswith("backbone.")}
    assert {f"backbone.{name}.weight" for name in held} == only_blocked and held  # (which: autotuning's choice)
    assert all(type(m) is not nn.Linear or f"backbone.{name}.weight" in forms for name, m in layers)
    assert_the_eager_logits(compiled, model, tokenizer(PROMPT, return_tensors="pt").input_ids, *FORK)  # eager: kernel
    again = CompiledPass(Target(model), buckets=(bucket,), length=64)  # the key unchanged: no second compile
    assert again._package_path() == compiled._package_path()


def test_the_blocks_kernel_multiplies_by_a_weight_held_in_blocks_alike_for_every_row_count():
    """`PanelLinear`'s product (`panel_mm`): x W^T to float32 rounding for block widths of 8 to 32 columns, widths
    that are no multiple of them and any row count; each row's output bit for bit the same alone or among others (a
    prompt's prefill, a tree and a batch compute a row alike)."""
    if not kernels():
        pytest.skip("no AVX2 here: mtp's kernels are not built, and layers keep their weights")
    generator = torch.Generator().manual_seed(0)
    for rows, inner, bn in [(576, 576, 8), (192, 64, 16), (100, 40, 24), (13, 5, 32)]:
        weight, bias = torch.randn(rows, inner, generator=generator), torch.randn(rows, generator=generator)
        layer = constants.PanelLinear(constants.blocked(weight, bn), rows, bias)
        assert torch.equal(layer.weight, weight)
        x = torch.randn(3, 19, inner, generator=generator)
        out = layer(x)
        torch.testing.assert_close(out, x @ weight.T + bias, atol=1e-4, rtol=1e-5)
        assert all(torch.equal(layer(x[1, i : i + 1]), out[1, i : i + 1]) for i in range(19))
        assert torch.equal(layer(x[2, 3:9]), out[2, 3:9])


@pytest.mark.slow
def test_a_model_mapped_from_its_file_holds_its_decoder_weights_once_when_compiled(tokenizer, monkeypatch, tmp_path):
    """A model loaded from safetensors (its weights mapped from the file): once its pass is compiled with the
    templates, the pages of the decoder layers' linear weights are no longer in the process (the blocks hold them),
    the embedding's are; greedy decoding is as before."""
    if not kernels():
        pytest.skip("no AVX2 here: mtp's kernels are not built, and layers keep their weights")
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    tiny_model(seed=4, hidden_size=256, intermediate_size=1024).save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, prompt, 16)
    linears = [m.weight for m in model.model.layers.modules() if type(m) is nn.Linear]
    spans = [(w.data_ptr(), w.data_ptr() + w.nbytes) for w in linears]
    assert sum(end - start for start, end in spans) == 2 * 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 1024)

    def resident(start: int, end: int) -> int:  # bytes of the whole pages of [start, end) present in memory
        page = mmap.PAGESIZE
        first, last = -(-start // page), end // page
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            entries = struct.unpack(f"{last - first}Q", pagemap.read(8 * (last - first)))
        return page * sum(entry >> 63 for entry in entries)

    before = sum(resident(*span) for span in spans)
    compiled = CompiledPass(Target(model), buckets=(1, 4), length=64)
    compiled.warm_up()
    del linears
    after = sum(resident(*span) for span in spans)
    embedding = model.get_input_embeddings().weight
    assert before >= 0.9 * sum(end - start for start, end in spans) and after <= 0.02 * before
    assert resident(embedding.data_ptr(), embedding.data_ptr() + embedding.nbytes) > 0.9 * embedding.nbytes
    oracle = OracleHeads(model, torch.cat([prompt[0], torch.tensor(expected)]), num_heads=3)
    result = Decoder(model, tokenizer, oracle, SMALL, compiled=compiled).generate(PROMPT, 16)
    assert result.token_ids == expected


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_quantized_base_compiles_to_its_eager_logits_and_reads_its_blocks_in_place(
    weights, tokenizer, monkeypatch, tmp_path
):
    """A base whose linear layers keep their weights in blocks (mtp.quantized): the compiled pass calls the block
    kernel, its logits are the eager pass's over 1 and 3 nodes, its constants the model's own block tensors, and
    greedy decoding on it is its plain greedy decoding."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    model = quantize(tiny_model(seed=3), weights)
    compiled = CompiledPass(Target(model), buckets=(1, 4), length=64)
    compiled.warm_up()
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    one = (torch.tensor([[5]]), torch.tensor([[0]]), torch.ones(1, 1, 1, dtype=torch.bool))
    assert_the_eager_logits(compiled, model, prompt, *one)
    assert_the_eager_logits(compiled, model, prompt, *FORK)
    recipes = json.loads(compiled._package_path().with_suffix(".json").read_text())
    tensors = compiled._tensors
    blocks = {name for name in tensors if name.endswith((".q", ".scale", ".minimum"))}
    read = {
        name
        for constant, (name, form, _) in recipes.items()
        if name in blocks and form == "same" and compiled._constants[constant].data_ptr() == tensors[name].data_ptr()
    }
    assert len(blocks) == 15 * (3 if weights == "int4" else 2) and read == blocks
    heads = random_heads(model)
    result = Decoder(model, tokenizer, heads, SMALL, compiled=compiled).generate(PROMPT, max_new_tokens=24)
    assert result.token_ids == reference(model, tokenizer(PROMPT, return_tensors="pt").input_ids, 24)


def test_a_constant_the_package_reports_and_was_not_recorded_is_refused(tmp_path):
    """AOTInductor's loader only warns of a constant left out (a pass would then read nothing): mtp refuses it, and
    the load falls back to eager steps (`compile_pass`). A reported name shared by several constants is their base;
    a recorded constant the package does not read is not supplied."""
    package = tmp_path / "pass.pt2"
    constants.save(package, {"a_b": ["x", "same", 0], "constant3_0": ["x", "t", 0], "unread": ["x", "t", 0]}, {})
    recipes, _ = constants._read(package, ["a.b", "constant3"])
    assert set(recipes) == {"a_b", "constant3_0"}
    with pytest.raises(RuntimeError, match=r"the package's constants \['constant4'\] were not recorded"):
        constants._read(package, ["a.b", "constant4"])


def test_the_templates_float_micro_kernel_is_mtps_on_the_torch_it_installs():
    """The micro-kernel that keeps its accumulators in registers (an 8-node pass of SmolLM2 1.7 -> 1.5 one-node
    passes on the Zen 4 EPYC) replaces inductor's on the torch that scripts/setup.sh installs: a torch whose template
    no longer has the replaced text would silently lose it. (The test above computes through it.)"""
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmFP32Vec

    internals._accumulators_in_registers()
    assert internals._MICRO_KERNEL in CppMicroGemmFP32Vec.TEMPLATE_KERNEL


def test_on_avx2_a_float_product_of_8_rows_takes_the_micro_kernel_of_8_rows():
    """On AVX2, 8 rows (or 16) multiply as one block of 8 rows by 8 columns, read each weight once for all of them;
    1 or 4 rows keep inductor's preferred 4 rows by 24 columns (its choice made for a graph's product, here outside
    one)."""
    internals._eight_rows_at_once()  # (imports inductor's kernels in the order they import each other)
    internals._eight_rows_at_once()  # once is enough: a second call changes nothing
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.cpu_vec_isa import VecAVX2
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    graph = types.SimpleNamespace(sizevars=SizeVarAllocator())
    with mock.patch.object(cpp_micro_gemm, "pick_vec_isa", VecAVX2), V.set_graph_handler(graph):
        blocks = {
            rows: tuple(
                cpp_micro_gemm.create_micro_gemm(
                    "product", rows, 576, 576, torch.float, torch.float, num_threads=2
                ).register_blocking
            )
            for rows in (1, 4, 8, 16)
        }
    assert blocks == {1: (4, 24, 1), 4: (4, 24, 1), 8: (8, 8, 1), 16: (8, 8, 1)}


def test_the_static_cache_after_acceptance_equals_a_causal_run(model, compiled, tokenizer):
    """Steps of oracle heads accept several nodes each, copied into place from their padded pass; the filled slots
    then hold what a causal run over the prompt and the settled tokens caches."""
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, prompt, 40)
    oracle = OracleHeads(model, torch.cat([prompt[0], torch.tensor(expected)]), num_heads=3)
    decoder = Decoder(model, tokenizer, oracle, SMALL, compiled=compiled)
    batch = decoder.batch()
    settled = [batch.add(prompt)]
    for _ in range(5):
        ((tokens, _),) = batch.step()
        settled += tokens
    assert batch.static and len(settled) > 5 + 1  # accepted more than the bonus tokens, on the static cache
    filled = batch.slots.shape[1]
    assert filled == prompt.shape[1] + len(settled) - 1  # the last settled token is the next root, not cached
    causal = prefilled(model, torch.cat([prompt[0], torch.tensor(settled[:-1])])[None])
    keys, values = compiled.cache.stacked  # every layer's keys and values views of two tensors, moved at once
    assert all(layer.keys._base is keys and layer.values._base is values for layer in compiled.cache.layers)
    for ours, theirs in zip(compiled.cache.layers, causal.layers, strict=True):
        torch.testing.assert_close(ours.keys[:, :, :filled], theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values[:, :, :filled], theirs.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("heads", ["none", "random", "oracle"])
def test_greedy_decoding_on_the_compiled_pass_is_plain_greedy_and_compiles_nothing_more(
    model, compiled, tokenizer, heads, monkeypatch
):
    """200 new tokens, plain steps (bucket 1) or 4-node trees (bucket 4), without tracing or compiling anything."""
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, prompt, 200)
    drafter = {
        "none": None,
        "random": random_heads(model, num_heads=3),
        "oracle": OracleHeads(model, torch.cat([prompt[0], torch.tensor(expected)]), num_heads=3),
    }[heads]

    def forbidden(*args, **kwargs):
        raise AssertionError("traced or compiled while decoding")

    monkeypatch.setattr(torch.export, "export", forbidden)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", forbidden)
    graphs = counters["stats"]["unique_graphs"]
    result = Decoder(model, tokenizer, drafter, SMALL, compiled=compiled).generate(PROMPT, max_new_tokens=200)
    assert counters["stats"]["unique_graphs"] == graphs  # nor through torch.compile
    assert result.token_ids == expected
    if heads == "oracle":
        assert result.tau > 2.5


def test_batches_and_requests_past_the_cache_move_to_eager_steps_and_stay_exact(model, compiled, tokenizer):
    """Three prompts two at a time (the second row's arrival moves the first's cache to a dynamic one) and one
    prompt of 300 new tokens past the 256 slots (moved when its next pass would not fit), with trees past the
    largest bucket on the way: each output is the prompt's own greedy output."""
    prompts = [PROMPT, "Hi", "The quick brown fox jumps over the lazy dog"]
    heads = random_heads(model, num_heads=4)
    for tree in (SMALL, TREE):
        decoder = Decoder(model, tokenizer, heads, tree, compiled=compiled)
        results = decoder.generate(prompts, max_new_tokens=30, batch_size=2)
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids == reference(model, tokenizer(prompt, return_tensors="pt").input_ids, 30)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    batch = Decoder(model, tokenizer, heads, SMALL, compiled=compiled).batch()
    settled, static = [batch.add(prompt, max_length=prompt.shape[1] + 300)], []
    while len(settled) < 300:
        static.append(batch.static)
        ((tokens, _),) = batch.step()
        settled += tokens
    assert static[0] and not static[-1] and static == sorted(static, reverse=True)  # static, then eager for good
    assert settled[:300] == reference(model, prompt, 300)


def test_two_interleaved_streams_of_one_decoder_do_not_share_the_static_cache(model, compiled, tokenizer):
    """The first stream decodes on the static cache; the second, started while the first runs, decodes eagerly;
    both answers are their prompts' own greedy output."""
    decoder = Decoder(model, tokenizer, random_heads(model, num_heads=3), SMALL, compiled=compiled)
    prompts, results = [PROMPT, "The quick brown fox jumps over the lazy dog"], [GenerationResult(), GenerationResult()]
    streams = [decoder.stream(prompt, 40, result=result) for prompt, result in zip(prompts, results, strict=True)]
    for _ in zip_longest(*streams):
        pass
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference(model, tokenizer(prompt, return_tensors="pt").input_ids, 40)


def test_lookup_past_the_largest_bucket_is_cut_to_it_and_every_pass_runs_compiled(
    model, compiled, tokenizer, monkeypatch
):
    """Prompt lookup proposing up to 10 tokens beside a 4-node tree, 4 nodes the largest bucket: lookup's nodes past
    it are dropped, so no pass runs eagerly over more nodes, and greedy output stays plain greedy."""
    text = "one two three four five six seven eight nine ten eleven twelve " * 3
    run, sizes, cuts, head = compiled.run, [], [], Tree.head
    monkeypatch.setattr(compiled, "run", lambda tokens, *rest: sizes.append(tokens.shape[1]) or run(tokens, *rest))
    monkeypatch.setattr(Tree, "head", lambda tree, size: cuts.append(tree.size > size) or head(tree, size))
    decoder = Decoder(
        model, tokenizer, random_heads(model, num_heads=3), SMALL, Lookup((10, 10, 10)), compiled=compiled
    )
    result = decoder.generate(text, max_new_tokens=40)
    assert result.token_ids == reference(model, tokenizer(text, return_tensors="pt").input_ids, 40)
    assert any(cuts) and max(sizes) == 4  # lookup proposed past 4 nodes, and was cut


def test_a_sliding_window_model_keeps_its_window_when_compiled(tokenizer):
    """Mistral with a window of 16: the compiled pass takes the windowed mask, and 60 tokens (past the window)
    equal plain greedy decoding."""
    model = tiny_model("mistral", **SLIDING["mistral"])
    compiled = CompiledPass(Target(model), buckets=(4,), length=128, templates=False)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    result = Decoder(model, tokenizer, random_heads(model, num_heads=3), SMALL, compiled=compiled).generate(
        PROMPT, max_new_tokens=60
    )
    assert result.token_ids == reference(model, prompt, 60)


def test_two_models_compiled_in_one_process_decode_each_on_its_own_weights_and_cache(model, compiled, tokenizer):
    """A second tiny Llama, other weights, compiled with the same shapes as the module's: each decoder's greedy
    output is its own model's (a pass that found the other's graph would run its frozen weights over its cache)."""
    other = tiny_model(seed=1)
    second = CompiledPass(Target(other), every_layer=True, buckets=(1, 4), length=256, templates=False)
    second.warm_up()
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    for each, its_pass in [(other, second), (model, compiled), (other, second)]:
        decoder = Decoder(each, tokenizer, random_heads(each, num_heads=3), SMALL, compiled=its_pass)
        assert decoder.generate(PROMPT, max_new_tokens=20).token_ids == reference(each, prompt, 20)


def test_a_pass_that_does_not_compile_leaves_eager_steps_with_one_line(model, monkeypatch, capsys):
    def fail(self):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(compiled_module.CompiledPass, "warm_up", fail)
    assert compile_pass(model, True) is None
    error = capsys.readouterr().err
    assert "could not compile llama's verification pass (RuntimeError: no C++ compiler found)" in error
    assert "decoding steps run eagerly" in error and "more detail" not in error
    monkeypatch.setenv("MTP_COMPILE", "0")
    assert compile_pass(model) is None  # the environment's default, as the tests run


def test_a_pass_that_cannot_even_be_built_leaves_eager_steps_with_one_line(model, monkeypatch, capsys):
    """Inductor's settings and patches are made before anything compiles: where they fail (a torch whose internals
    moved), the decoder still decodes, eagerly."""

    def moved(templates):
        raise AttributeError("module 'torch._inductor.config' has no attribute 'cpp'")

    monkeypatch.setattr(internals, "cpu_pass_settings", moved)
    assert compile_pass(model, True) is None
    assert "(AttributeError: module 'torch._inductor.config' has no attribute 'cpp'): decoding steps run eagerly" in (
        capsys.readouterr().err
    )


def test_inductors_patches_are_skipped_outside_the_torch_they_were_written_for_and_a_failure_said(monkeypatch, capsys):
    monkeypatch.setattr(internals, "_say", lambda line: print(line, file=sys.stderr))  # (said once per process)
    monkeypatch.setattr(internals, "TORCH", ("2.0",))
    settings = internals.cpu_pass_settings(True)
    assert settings["max_autotune"] and "max_autotune_report_choices_stats" not in settings
    assert f"inductor's patches are written for torch 2.0, not {torch.__version__}: skipped" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(internals, "_say", lambda line: print(line, file=sys.stderr))

    def _accumulators_in_registers():  # (the patch's stand-in, named as it)
        raise AttributeError("type object 'CppMicroGemmFP32Vec' has no attribute 'TEMPLATE_KERNEL'")

    monkeypatch.setattr(internals, "_accumulators_in_registers", _accumulators_in_registers)
    assert internals.cpu_pass_settings(True)["max_autotune_report_choices_stats"] is False
    error = capsys.readouterr().err.splitlines()
    assert error == [
        "mtp: accumulators_in_registers skipped (AttributeError: type object 'CppMicroGemmFP32Vec' has no "
        "attribute 'TEMPLATE_KERNEL'): passes of 4 and 8 nodes up to 1.5x slower"
    ]


def test_buckets_are_checked():
    with pytest.raises(ValueError, match=r"buckets=\(4, 1\): give node counts from 1 up, ascending"):
        CompiledPass(Target(tiny_model()), buckets=(4, 1))


@pytest.mark.slow
def test_the_compiled_pass_is_kept_on_disk_and_loaded_later_for_the_same_weights_only(
    model, tokenizer, monkeypatch, tmp_path, capsys
):
    """On a CPU the pass is an AOTInductor package in mtp's cache folder, made once: a later pass of the same model
    (as in a later process) loads it without tracing or compiling, and says that it loads. The weights are frozen
    into a package, so a model of the same shapes with other weights gets a package of its own, and decodes on its
    own weights."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    made, make = [], torch._inductor.aoti_compile_and_package
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: made.append(1) or make(*a, **k))
    CompiledPass(Target(model), buckets=(2,), length=64, templates=False).warm_up()
    assert len(made) == 1 and len(list((tmp_path / "passes").glob("*-2.pt2"))) == 1
    assert "mtp: compiling the verification pass for 2 nodes on cpu" in capsys.readouterr().err
    CompiledPass(Target(model), buckets=(2,), length=64, templates=False).warm_up()
    assert len(made) == 1  # loaded
    assert (
        f"mtp: loading the verification pass compiled for 2 nodes (from {tmp_path / 'passes'}) 2: "
        in capsys.readouterr().err
    )
    other = tiny_model(seed=1)
    second = CompiledPass(Target(other), buckets=(2,), length=64, templates=False)
    second.warm_up()
    assert len(made) == 2 and len(list((tmp_path / "passes").glob("*-2.pt2"))) == 2
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    decoder = Decoder(other, tokenizer, random_heads(other, num_heads=3), Tree.from_paths([(0,)]), compiled=second)
    assert decoder.generate(PROMPT, max_new_tokens=20).token_ids == reference(other, prompt, 20)


@pytest.mark.slow
def test_every_bucket_runs_one_package_and_plain_decoding_compiles_one_node(model, tokenizer, monkeypatch, tmp_path):
    """The node count is a dimension of one package's inputs: buckets 1, 4 and 8 compile one package (so the
    weights it freezes are held once) whose passes over 1 to 8 nodes give the eager logits; `compile_pass` for a
    decoder of at most one node a pass (plain decoding) compiles bucket 1 alone, and for 3 nodes buckets 1 and 4."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    made, make = [], torch._inductor.aoti_compile_and_package
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: made.append(1) or make(*a, **k))
    compiled = CompiledPass(Target(model), buckets=(1, 4, 8), length=64, templates=False)
    compiled.warm_up()
    assert len(made) == 1 and [p.name[25:] for p in (tmp_path / "passes").glob("*.pt2")] == ["1-4-8.pt2"]
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    for size in (1, 3, 4, 6, 8):
        tokens = torch.randint(0, 512, (1, size), generator=torch.Generator().manual_seed(size))
        with torch.no_grad():
            compiled.load(prefilled(model, prompt))
            positions, slots = prompt.shape[1] + torch.arange(size)[None], torch.arange(prompt.shape[1])[None]
            ours = compiled.run(tokens, positions, torch.ones(1, size, size, dtype=torch.bool).tril(), slots)
            causal = model(input_ids=torch.cat([prompt, tokens], 1)).logits[:, prompt.shape[1] :]
        torch.testing.assert_close(ours.logits, causal, atol=1e-5, rtol=1e-4)
    monkeypatch.setattr(
        compiled_module,
        "CompiledPass",
        lambda target, every_layer, buckets: types.SimpleNamespace(buckets=buckets, warm_up=lambda: None),
    )
    assert compile_pass(model, True, nodes=1).buckets == (1,)
    assert compile_pass(model, True, nodes=3).buckets == (1, 4)
    assert compile_pass(model, True, nodes=11).buckets == (1, 4, 8)


def test_the_vector_instructions_checked_once_on_a_machine_are_trusted_while_the_cpu_reports_the_same(
    monkeypatch, tmp_path
):
    """Inductor compiles and loads a program per instruction set in every process (24 s on the 2-core Zen 4 EPYC);
    mtp keeps what the check found per machine and torch version and, later, skips the check while what the CPU
    reports picks the same set; a record of another set (a changed machine or compiler) checks again."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    with inductor_config.patch({"cpp.vec_isa_ok": None}):  # (inductor's own patch: undone whole, for later tests)
        with inductor_config.patch({"cpp.vec_isa_ok": True}):
            reported = str(pick_vec_isa())
        key = f"{device_name('cpu')}, torch {torch.__version__}"
        for recorded, settings in [(reported, {"cpp.vec_isa_ok": True}), ("another set", {})]:
            (tmp_path / "vector_isa.json").write_text(json.dumps({key: recorded}))
            assert internals._vector_isa() == settings
    with inductor_config.patch({"cpp.vec_isa_ok": False}):  # the user's own setting stays
        assert internals._vector_isa() == {}


def test_two_threads_decoding_with_one_decoder_each_answer_as_plain_greedy(model, compiled, tokenizer):
    """The first thread to claim the static cache decodes on it, the other eagerly until it is freed; neither
    disturbs the other, and the cache is free once both end."""
    decoder = Decoder(model, tokenizer, random_heads(model, num_heads=3), SMALL, compiled=compiled)
    prompts = [PROMPT, "Name three primary colours:", PROMPT[:12], "Once upon a time"]
    answers = {}

    def answer(i: int) -> None:
        answers[i] = decoder.generate(prompts[i], max_new_tokens=30).token_ids

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = [reference(model, tokenizer(prompt, return_tensors="pt").input_ids, 30) for prompt in prompts]
    assert [answers.get(i) for i in range(len(prompts))] == expected
    assert compiled._holder is None


def test_a_stream_interrupted_mid_step_leaves_the_decoder_decoding_the_next_prompt_compiled(
    model, compiled, tokenizer, monkeypatch
):
    decoder = Decoder(model, tokenizer, random_heads(model, num_heads=3), SMALL, compiled=compiled)
    step, steps = Batch.step, []

    def interrupted(batch):
        steps.append(batch.static)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step(batch)

    monkeypatch.setattr(Batch, "step", interrupted)
    with pytest.raises(KeyboardInterrupt) as kept:  # (its traceback kept alive, as a notebook keeps the last one)
        for _ in decoder.stream(PROMPT, max_new_tokens=30):
            pass
    assert steps == [True] * 3 and kept.traceback
    passes = []
    monkeypatch.setattr(Batch, "step", lambda batch: passes.append(batch.static) or step(batch))
    expected = reference(model, tokenizer(PROMPT, return_tensors="pt").input_ids, 30)
    assert decoder.generate(PROMPT, max_new_tokens=30).token_ids == expected and passes and all(passes)


def test_a_row_outgrowing_the_static_cache_goes_on_eagerly_losslessly_said_once(
    model, compiled, tokenizer, monkeypatch, capsys
):
    decoder = Decoder(model, tokenizer, random_heads(model, num_heads=3), SMALL, compiled=compiled)
    monkeypatch.setattr(compiled, "_outgrown", False)
    for words in (28, 22):  # a prompt past the cache's 256 slots; one that its answer takes past them
        prompt = " ".join(["three four five"] * words)
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert (input_ids.shape[1] > compiled.length) == (words == 28)
        assert decoder.generate(prompt, max_new_tokens=60).token_ids == reference(model, input_ids, 60)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("mtp: a row of ") and "outgrows the compiled pass's 256" in said[0]
