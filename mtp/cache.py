"""KV-cache bookkeeping after a tree verification pass: keep the accepted path, drop the rest."""

import torch
from transformers import DynamicCache


def keep_accepted(cache: DynamicCache, prefix_len: int, nodes: torch.Tensor) -> None:
    """Keep the cache entries of the accepted tree `nodes` right after the first `prefix_len` entries.

    Before: prefix_len entries, then one entry per tree node. After: prefix_len + len(nodes) entries, the
    accepted nodes in path order, exactly what a causal pass over prefix + accepted tokens would have cached
    (each node's keys and values were computed at its depth's position, attending to its ancestors only).
    """
    positions = prefix_len + nodes  # (A,) where the accepted nodes sit now
    for layer in cache.layers:
        kept = prefix_len + len(nodes)
        for states in (layer.keys, layer.values):  # (B, H, T, D)
            states[:, :, prefix_len:kept] = states[:, :, positions]
        layer.crop(kept - layer.keys.shape[-2])
