"""`mtp.load`: a decoder ready to generate, from a drafter's folder and the base model it was trained for."""

import torch

from mtp.decoding.compiled import compile_pass
from mtp.decoding.costs import candidates, machine_pacer
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import Lookup
from mtp.decoding.tree import DEFAULT_TREE, DynamicTree, Tree, grow_tree, named_tree
from mtp.drafters.contract import load_with_base
from mtp.linears import fast_linears

MAX_NODES = 64  # the largest tree a drafter's calibration grows for pacing (as `mtp.tools.sizing` grows it)


def load(
    drafter: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    tree: str | None = None,
    base_model: str | None = None,
    lookup: Lookup | None = None,
    heads_path: str | None = None,
    compile: bool | None = None,
    weights: str = "float",
) -> Decoder:
    """A decoder with the drafter in the folder `drafter` and the base model it was trained for.

    Args:
        drafter: a folder written at the end of training (`config.json` + `model.safetensors`), a
            FasterDecoding Medusa checkpoint folder, an EAGLE-3 drafter's folder, or the Hub repository id
            (`owner/name`) of one.
        device: torch device.
        dtype: parameter dtype of the base model and the drafter.
        tree: a named tree (see `mtp.decoding.tree.NAMED_TREES`), a number N, the N-node tree grown from the heads'
            calibration, or `dynamic:NODES:DEPTH:TOP_K`, a tree grown every step (`mtp.decoding.tree.DynamicTree`).
        base_model: load this base instead of the one named in the heads' config (for example a local copy);
            it must be the same model: hidden size, vocabulary and tokenizer are checked.
        lookup: prompt lookup's candidates beside the drafter's each step (`mtp.decoding.lookup`); `Lookup((0,))`:
            none.
        heads_path: `drafter`'s former name, still taken (give one of the two).
        compile: run a lone prompt's verification passes compiled (`mtp.decoding.compiled`: compiled when loading,
            minutes the first time on a small CPU); None: unless the environment sets MTP_COMPILE=0.
        weights: the base's weights: "float" (as loaded), "int8" or "int4" (put in blocks of 32), or "gguf" (a GGUF
            base's own blocks, such as the packaged default's 4-bit ones): see `mtp.quantized`.

    With neither `tree` nor `lookup` (nor a `dynamic_tree` in the heads' config), each step's tree and lookup are
    chosen by expected speed on this machine (`mtp.decoding.pacing`), from what the heads' candidates accept and the
    step costs measured here once (`mtp.decoding.costs`; the first load on a machine says in one line what it measured
    and chose), per prompt as it goes, down to plain decoding where no tree pays. Given ones hold for every step (a
    given lookup beside the tree the heads saved, else the default tree; a given tree beside the lookup they saved).
    """
    if (drafter is None) == (heads_path is None):
        raise TypeError("mtp.load takes the drafter's folder (or Hub id) once: as `drafter`, or as `heads_path`.")
    drafter, model, tokenizer = load_with_base(drafter or heads_path, base_model, device, dtype, weights=weights)
    fast_linears(drafter)  # its few rows per step, as the base model's: the product measured fastest here
    config, num_heads = drafter.config, drafter.config.num_heads
    compiled = compile_pass(model, compile, every_layer=bool(config.feature_layers))
    if tree is None and lookup is None and config.dynamic_tree is None and config.calibration is not None:
        paths, expected = grow_tree(config.calibration, MAX_NODES)
        pacer = machine_pacer(model, tokenizer, drafter, candidates(config, paths, expected), paths, compiled)
        return Decoder(model, tokenizer, drafter, pacer=pacer, compiled=compiled)
    if tree is None and config.dynamic_tree:
        chosen = DynamicTree.parse(config.dynamic_tree)
    elif tree is not None or config.tree is None:
        chosen = named_tree(tree or DEFAULT_TREE, num_heads, config.calibration)
    else:
        chosen = Tree.from_paths(config.tree, num_heads=num_heads)
    if lookup is None:
        lookup = Lookup(tuple(config.lookup) or (0,))
    return Decoder(model, tokenizer, drafter, chosen, lookup, compiled=compiled)
