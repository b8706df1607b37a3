"""mtp: train multi-token-prediction heads on a frozen Hugging Face causal LM, and decode with them."""

import torch

from mtp.base import load_base
from mtp.decoding import Decoder, GenerationResult
from mtp.folder import Drafter
from mtp.linears import fast_linears, usual_linears
from mtp.lookup import Lookup
from mtp.sampling import Sampling
from mtp.tree import DEFAULT_TREE, DynamicTree, Tree, named_tree

__all__ = ["Decoder", "GenerationResult", "Lookup", "Sampling", "fast_linears", "load", "usual_linears"]


def load(
    heads_path: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    tree: str | None = None,
    base_model: str | None = None,
    lookup: Lookup | None = None,
) -> Decoder:
    """A decoder with the heads in `heads_path` and the base model they were trained for.

    Args:
        heads_path: a folder written at the end of training (`config.json` + `model.safetensors`), a
            FasterDecoding Medusa checkpoint folder, an EAGLE-3 drafter's folder, or the Hub repository id
            (`owner/name`) of one.
        device: torch device.
        dtype: parameter dtype of the base model and heads.
        tree: a named tree (see `mtp.tree.NAMED_TREES`), a number N, the N-node tree grown from the heads'
            calibration, or `dynamic:NODES:DEPTH:TOP_K`, a tree grown every step (`mtp.tree.DynamicTree`); default:
            the tree saved with the heads (`python -m mtp.sizing`), else the default tree.
        base_model: load this base instead of the one named in the heads' config (for example a local copy);
            it must be the same model: hidden size, vocabulary and tokenizer are checked.
        lookup: prompt lookup's candidates beside the heads' each step (see `mtp.lookup`); default: the
            lengths `mtp.sizing` chose for the heads (none if it chose none); `Lookup((0,))`: none.

    With neither `tree` nor `lookup` given, steps over several prompts at once take the trees and lookups that
    `mtp.sizing` chose per batch size (`HeadsConfig.batch_trees`); a given one holds for every step.
    """
    heads = Drafter.from_pretrained(heads_path)
    name = base_model or heads.config.base_model
    model, tokenizer = load_base(name, device=device, dtype=dtype)
    heads.check_base(name, model, tokenizer)
    model = heads.adapt(model)
    num_heads = heads.config.num_heads
    if tree is None and heads.config.dynamic_tree:
        chosen = DynamicTree.parse(heads.config.dynamic_tree)
    elif tree is not None or heads.config.tree is None:
        chosen = named_tree(tree or DEFAULT_TREE, num_heads, heads.config.calibration)
    else:
        chosen = Tree.from_paths(heads.config.tree, num_heads=num_heads)
    batch_trees = {}  # sized for steps over several prompts, unless the caller chose the tree or lookup
    if tree is None and lookup is None:
        for plan in heads.config.batch_trees:
            plan_tree = Tree.from_paths(plan["tree"], num_heads=num_heads)
            batch_trees[plan["rows"]] = plan_tree, Lookup(tuple(plan["lookup"]) or (0,))
    if lookup is None:
        lookup = Lookup(tuple(heads.config.lookup) or (0,))
    heads = heads.to(device=device, dtype=dtype).eval()
    fast_linears(heads)  # their few rows per step, as the base model's: the product measured fastest here
    return Decoder(model, tokenizer, heads, chosen, lookup, batch_trees)
