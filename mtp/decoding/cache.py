"""What a tree verification pass attends to, and the KV cache after it.

The cache keeps every position, on every layer, sliding-window layers included (a `DynamicCache()` built
without the model's config). transformers' sliding cache layers keep only the last `window - 1` entries
after each forward pass, tree nodes included: a pass over a 9-node tree would evict 9 prefix entries, and
those that the accepted path still needs are gone once the rejected nodes are dropped. With every position
kept, the cache after `keep_accepted` is exactly a causal run's, and the window is expressed where it is
exact: in the 4D attention mask, per layer type, a query at position q seeing a key at position k iff
q - k < window (the rule of transformers' `sliding_window_overlay`). The price is memory: sliding layers
cache the whole context instead of a window, as full-attention layers do anyway.

Rows of a batch share one cache (B, heads, T, head_dim) whose T slots need not line up across rows: `slots`
(B, T) holds the position, in its own row, of the token that each slot caches, and -1 for an empty slot. A
row's prompt fills the slots of its own prefill, padded with empty ones to the batch's length; each step, the
accepted nodes of every row go to the A slots after those there were before the pass (A: the most that any
row accepted), and the slots a row does not fill stay empty. Which slot holds a token does not matter to
attention: a cached key carries its position already (rotary or learned position embeddings are applied before
caching), so the mask lets a query see the filled slots of its own row (within a sliding layer's window, by
position) and nothing else. Empty slots cost attention work, never a wrong value; slots empty in every row are
dropped whenever rows leave.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache, PretrainedConfig

LAYER_TYPES = ("full_attention", "sliding_attention")
GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"  # see `grouped_keys`


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
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    windows: dict[str, int | None],
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """The additive 4D mask (B, 1, Q, T+Q) of a pass over each row's tree nodes after the cached slots: a node sees
    the filled slots of its row and its own ancestors, minus what lies outside a sliding layer's window. One mask,
    or one per layer type (the form transformers' models take for mixed full and sliding layers); None when there
    is nothing to mask (the root alone after filled slots, no window): the model's own path for one new token.

    Args:
        tree_mask: (B, Q, Q) bool, node i of a row sees node j of the same row.
        positions: (B, Q) each node's position in its row.
        slots: (B, T) the position of the token cached in each slot, -1 for an empty slot.
        windows: `attention_windows` of the model.
        dtype: the model's dtype.
    """
    queries = tree_mask.shape[1]
    if queries == 1 and all(window is None for window in windows.values()) and bool((slots >= 0).all()):
        return None
    seen = torch.cat([(slots >= 0)[:, None].expand(-1, queries, -1), tree_mask], 2)  # (B, Q, T+Q)
    keys = torch.cat([slots, positions], 1)  # (B, T+Q) every key's position
    masks, blocked = {}, torch.finfo(dtype).min
    for kind, window in windows.items():
        visible = seen if window is None else seen & (positions[:, :, None] - keys[:, None] < window)
        masks[kind] = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, blocked)
        masks[kind] = masks[kind][:, None]  # (B, 1, Q, T+Q)
    return masks if len(masks) > 1 else masks[next(iter(masks))]


@contextmanager
def grouped_keys(on: bool) -> Iterator[None]:
    """If `on`, a masked SDPA pass inside this block attends grouped-query keys and values as they are cached (mtp
    turns it on for passes of more than one query on a CPU).

    Given a mask and more than one query, transformers copies each layer's keys and values once per query group
    (`repeat_kv`: on CUDA, SDPA takes groups and a mask together only on its slow path); PyTorch's CPU kernel takes
    both as they are, and skipping the copies saved 2-3 ms of a 2- to 4-node step of SmolLM2 here (38.5 -> 36.4 ms
    at 2 nodes, measured with `mtp.tools.sizing.measure_steps`). `TRANSFORMERS_SDPA_FORCE_GQA` is transformers' own
    switch for this; it is set for the pass only (process-wide while it runs), and left as the caller had it."""
    if not on:
        yield
        return
    before = os.environ.get(GQA_SWITCH)
    os.environ[GQA_SWITCH] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GQA_SWITCH, None)
        else:
            os.environ[GQA_SWITCH] = before


def keep_accepted(cache: DynamicCache, slots: torch.Tensor, nodes: list[torch.Tensor], prefix_lens: torch.Tensor):
    """Keep each row's accepted tree `nodes` in the A slots right after the T slots there were before the pass,
    A the most nodes any row accepted; returns the slots (B, T+A).

    Before: T slots, then one per tree node (Q). After: T + A slots; row b's accepted nodes in path order at
    positions prefix_lens[b], prefix_lens[b] + 1, ..., the rest of its new slots empty. Each node's keys and
    values were computed at its depth's position attending to its ancestors only: with the empty slots masked,
    the cache is exactly what a causal pass over the row's prefix and accepted tokens would have cached.

    Args:
        nodes: per row, the accepted nodes (A_b,), root first.
        prefix_lens: (B,) the tokens each row had cached before the pass: where its root sits.
    """
    length = slots.shape[1]
    accepted = torch.nn.utils.rnn.pad_sequence(nodes, batch_first=True, padding_value=-1)  # (B, A)
    end = length + accepted.shape[1]  # the slots after the pass
    # every row accepted the first nodes of its pass (a plain step, a chain): they are where they are kept
    in_place = torch.equal(accepted, torch.arange(accepted.shape[1], device=slots.device).expand_as(accepted))
    if not in_place:
        index = length + accepted.clamp(min=0)  # (B, A) the nodes' slots in the pass
        # (B, heads, T+Q, D) each layer's keys and values, or all layers' stacked in front (a compiled pass's cache)
        stacked = getattr(cache, "stacked", None)
        for states in stacked or [each for layer in cache.layers for each in (layer.keys, layer.values)]:
            if len(index) == 1:  # a lone row: one index for every head (a few times faster than the gather)
                states[..., length:end, :] = states.index_select(-2, index[0])
            else:
                every = index[:, None, :, None].expand(*states.shape[:-2], -1, states.shape[-1])
                states[..., length:end, :] = states.gather(-2, every)
    lengths = getattr(cache, "lengths", None)  # every layer's filled length in one tensor (a compiled pass's cache)
    if lengths is not None:
        lengths.fill_(end)
    else:
        passed = int(cache.get_seq_length())  # T + the pass's queries (a static layer's keys hold every slot)
        for layer in cache.layers:
            layer.crop(end - passed)
    new = prefix_lens[:, None] + torch.arange(accepted.shape[1], device=slots.device)  # (B, A)
    return torch.cat([slots, new.masked_fill(accepted < 0, -1)], 1)


def stack_rows(states: list[torch.Tensor], others: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of `states` (B, G, S, D) with the rows of its partner in `others` (B', G, S', D) after its own, the
    shorter padded with empty slots at the end: (B + B', G, max(S, S'), D) each."""
    length = max(states[0].shape[2], others[0].shape[2])

    def pad(x: torch.Tensor) -> torch.Tensor:  # (B, G, S, D) -> (B, G, length, D)
        return torch.nn.functional.pad(x, (0, 0, 0, length - x.shape[2]))

    return [torch.cat([pad(state), pad(other)]) for state, other in zip(states, others, strict=True)]


def select_rows(states: list[torch.Tensor], rows: torch.Tensor, filled: torch.Tensor) -> list[torch.Tensor]:
    """Each of `states` (B, G, S, D) with only `rows` (B,) and the slots `filled` (S,) bool."""
    return [state[rows][:, :, filled] for state in states]


def append_rows(cache: DynamicCache, slots: torch.Tensor, other: DynamicCache, other_slots: torch.Tensor):
    """Append the rows of `other` (its slots `other_slots`) to `cache`, the shorter of the two padded with empty
    slots; returns the slots of the joined rows."""
    length = max(slots.shape[1], other_slots.shape[1])
    for layer, new in zip(cache.layers, other.layers, strict=True):
        layer.keys, layer.values = stack_rows([layer.keys, layer.values], [new.keys, new.values])
    return torch.cat([torch.nn.functional.pad(s, (0, length - s.shape[1]), value=-1) for s in (slots, other_slots)])


def keep_rows(cache: DynamicCache, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keep only `rows` (B,) bool of the cache, and drop the slots then empty in every row; returns their slots."""
    slots = slots[rows]
    filled = (slots >= 0).any(0)  # (T,)
    for layer in cache.layers:
        layer.keys, layer.values = select_rows([layer.keys, layer.values], rows, filled)
    return slots[:, filled]
