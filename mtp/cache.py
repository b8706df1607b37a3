"""What a tree verification pass attends to, and the KV cache after it.

The cache keeps every position, on every layer, sliding-window layers included (a `DynamicCache()` built
without the model's config). transformers' sliding cache layers keep only the last `window - 1` entries
after each forward pass, tree nodes included: a pass over a 9-node tree would evict 9 prefix entries, and
those that the accepted path still needs are gone once the rejected nodes are dropped. With every position
kept, the cache after `keep_accepted` is exactly a causal run's, and the window is expressed where it is
exact: in the 4D attention mask, per layer type, a query at position q seeing a key at position k iff
q - k < window (the rule of transformers' `sliding_window_overlay`). The price is memory: sliding layers
cache the whole context instead of a window, as full-attention layers do anyway.
"""

import torch
from transformers import DynamicCache, PretrainedConfig

LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_windows(config: PretrainedConfig) -> dict[str, int | None]:
    """Each attention layer type of the model and its window (None: full attention)."""
    config = config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"{config.model_type} has attention layers of type {unknown}: tree decoding supports {LAYER_TYPES}."
        )
    return {kind: window if kind == "sliding_attention" else None for kind in dict.fromkeys(types)}


def tree_attention_mask(
    tree_mask: torch.Tensor, depths: torch.Tensor, prefix_len: int, windows: dict[str, int | None], dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive 4D mask of a pass over the tree's nodes after `prefix_len` cached positions: a node sees
    the whole prefix and its own ancestors, minus what lies outside a sliding layer's window. One mask, or one
    per layer type (the form transformers' models take for mixed full and sliding layers).

    Args:
        tree_mask: (N+1, N+1) bool, node i sees node j.
        depths: (N+1,) each node's depth; node i sits at position prefix_len + depths[i].
        prefix_len: cached positions before the tree.
        windows: `attention_windows` of the model.
        dtype: the model's dtype.
    """
    blocked = torch.finfo(dtype).min
    tree_part = torch.zeros(tree_mask.shape, dtype=dtype, device=depths.device).masked_fill_(~tree_mask, blocked)
    prefix = torch.zeros(len(depths), prefix_len, dtype=dtype, device=depths.device)  # (N+1, P) all seen
    full = torch.cat([prefix, tree_part], 1)[None, None]  # (1, 1, N+1, P+N+1)
    masks = {}
    for kind, window in windows.items():
        if window is None:
            masks[kind] = full
            continue
        positions = prefix_len + depths  # (N+1,)
        keys = torch.cat([torch.arange(prefix_len, device=depths.device), positions])  # (P+N+1,) every key's position
        masks[kind] = full.masked_fill(positions[:, None] - keys[None, :] >= window, blocked)  # out of the window
    return masks if len(masks) > 1 else masks[next(iter(masks))]


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
