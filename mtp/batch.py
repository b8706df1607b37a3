"""Rows in flight: B prompts decoded together, one verification pass of the base model over every row's tree per
step, each row accepting its own number of tokens. A single prompt is the batch of one.

A row joins with a prefill of its own prompt alone (its cache appended as a new row, see `mtp.cache`), so its
logits are exactly those of the prompt decoded alone and a waiting prompt can take the place of a finished one
at once; a row leaves as soon as its caller says it is done, and costs nothing after.
"""

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from mtp.cache import append_rows, grouped_keys, keep_accepted, keep_rows, tree_attention_mask
from mtp.sampling import Sampling, accept_exact, accept_typical, draw
from mtp.tree import LOOKUP, Tree

if TYPE_CHECKING:
    from mtp.decoding import Decoder


@dataclass
class Row:
    """One prompt of the batch."""

    prefix_len: int
    """Positions cached: the prompt and the tokens accepted so far. The next tree's root sits here."""
    root: int
    """The last settled token, not cached yet: the root of the next tree."""
    hidden: torch.Tensor
    """(H,) the base model's last hidden state at the last cached position."""
    max_length: int
    """The row ends at this length (prompt and new tokens): no node is placed at max_length - 1 or later."""
    sequence: torch.Tensor | None
    """(T,) the prompt and every settled token, for prompt lookup (None without it)."""

    @property
    def room(self) -> int:
        """How deep a tree may grow below the root: a node at max_length - 1 would be past the end, and the last
        token's own guess would only repeat the bonus token of its parent."""
        return max(self.max_length - 2 - self.prefix_len, 0)


def accept_greedy(tokens: torch.Tensor, predictions: torch.Tensor, paths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Along each root-to-leaf path, node d+1 is right iff its token is the base model's prediction at node d; the
    path with the most leading right nodes wins, and the prediction after its last is the bonus."""
    children = paths[:, 1:]  # (L, D)
    right = (children >= 0) & (tokens[children.clamp(min=0)] == predictions[paths[:, :-1].clamp(min=0)])
    accepted = right.int().cumprod(1).sum(1)  # (L,)
    best = int(accepted.argmax())
    nodes = paths[best, : int(accepted[best]) + 1]  # (A+1,)
    return nodes, int(predictions[nodes[-1]])


class Batch:
    """The rows decoded together by `decoder`, their shared cache and the sampling settings (one generator for
    all rows: each row's tokens are drawn from its own distributions, whatever the other rows draw)."""

    def __init__(self, decoder: "Decoder", sampling: Sampling):
        self.decoder, self.sampling, self.generator = decoder, sampling, sampling.generator()
        self.backbone = decoder.base_model.get_decoder()
        self.device = decoder.base_model.device
        self.rows: list[Row] = []
        self.cache, self.slots = DynamicCache(), None  # slots (B, T): see mtp.cache
        self.uses_lookup = any(lookup for _, lookup in decoder.plans.values())  # rows keep their text for it

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def add(self, input_ids: torch.Tensor, max_length: int | None = None) -> int:
        """Prefill the prompt `input_ids` (1, T) alone and add it as the last row; returns its first new token.
        `max_length`: the row ends at this length (default: the model's context window)."""
        cache = DynamicCache()  # every position on every layer: see mtp.cache
        hidden = self.backbone(input_ids=input_ids.to(self.device), cache=cache, use_cache=True).last_hidden_state
        logits = self.decoder.logits(hidden[0, -1])  # (V,)
        if self.sampling.greedy:
            root = int(logits.argmax())
        else:
            root = draw(self.sampling.probabilities(logits).cpu(), self.generator)
        slots = torch.arange(input_ids.shape[1], device=self.device)[None]  # (1, T)
        if self.rows:
            self.slots = append_rows(self.cache, self.slots, cache, slots)
        else:
            self.cache, self.slots = cache, slots
        sequence = torch.cat([input_ids[0].cpu(), torch.tensor([root])]) if self.uses_lookup else None
        max_length = max_length or self.decoder.context or sys.maxsize
        self.rows.append(Row(input_ids.shape[1], root, hidden[0, -1], max_length, sequence))
        return root

    def keep(self, rows: list[bool]) -> None:
        """Keep the rows marked True, in order; the others leave the batch."""
        if all(rows):
            return
        self.rows = [row for row, kept in zip(self.rows, rows, strict=True) if kept]
        if self.rows:
            self.slots = keep_rows(self.cache, self.slots, torch.tensor(rows, device=self.device))
        else:
            self.cache, self.slots = DynamicCache(), None

    def _draft(self) -> tuple[list[Tree], list[torch.Tensor]]:
        """Each row's tree and its tokens (N_b+1,): the heads' tree of the decoder's plan for this many rows, cut
        to the room of the row with the least, with the row's prompt-lookup chain grafted on."""
        decoder = self.decoder
        tree, lookup = decoder.plan(len(self.rows), min(row.room for row in self.rows))
        tokens = torch.tensor([[row.root] for row in self.rows], device=self.device)  # (B, 1) the roots
        if tree.size > 1:  # (B, N+1) the roots and the heads' guesses
            hidden = torch.stack([row.hidden for row in self.rows])  # (B, H)
            tokens = decoder.heads.tree_tokens(hidden, tokens, tree, decoder.lm_head, decoder.embed, tree.top_k)
        if lookup is None:
            return [tree] * len(self.rows), list(tokens)
        chains = [lookup.propose(row.sequence)[: row.room] for row in self.rows]
        grafts = [tree.graft(row_tokens, chain) for row_tokens, chain in zip(tokens, chains, strict=True)]
        return [grafted for grafted, _ in grafts], [row_tokens for _, row_tokens in grafts]

    @torch.no_grad()
    def step(self) -> list[tuple[list[int], int]]:
        """One verification pass over every row's tree: per row, the tokens it settles (the accepted candidates
        and the bonus token) and how many of them prompt lookup alone proposed."""
        with record_function("mtp.candidates"):  # the heads' guesses (and lookup's) laid out on each row's tree
            trees, tokens = self._draft()
            size = max(tree.size for tree in trees)  # rows with smaller trees are padded with nodes seen by none
            batch = torch.zeros(len(trees), size, dtype=torch.long, device=self.device)  # (B, Q) tokens
            depths = torch.zeros_like(batch)  # (B, Q)
            mask = torch.eye(size, dtype=torch.bool, device=self.device).repeat(len(trees), 1, 1)  # (B, Q, Q)
            for b, (tree, row_tokens) in enumerate(zip(trees, tokens, strict=True)):
                batch[b, : tree.size], depths[b, : tree.size] = row_tokens, tree.depths
                mask[b, : tree.size, : tree.size] = tree.mask
            prefix_lens = torch.tensor([row.prefix_len for row in self.rows], device=self.device)  # (B,)
            positions = prefix_lens[:, None] + depths  # (B, Q) a node sits at its depth past its row's root
            dtype = self.decoder.base_model.dtype
            attention = tree_attention_mask(mask, positions, self.slots, self.decoder.windows, dtype)
        with record_function("mtp.verify"), grouped_keys(self.device.type == "cpu" and size > 1):  # one base pass
            hidden = self.backbone(
                input_ids=batch, position_ids=positions, attention_mask=attention, cache=self.cache, use_cache=True
            ).last_hidden_state  # (B, Q, H)
        with record_function("mtp.accept"):
            logits = self.decoder.logits(hidden)  # (B, Q, V) the base model's next-token logits after each node
            predictions = logits.argmax(-1) if self.sampling.greedy else None  # (B, Q)
            accepted = []
            for b, (tree, row_tokens) in enumerate(zip(trees, tokens, strict=True)):
                row_logits = logits[b, : tree.size]  # (N_b+1, V)
                if self.sampling.greedy:
                    nodes, root = accept_greedy(row_tokens, predictions[b, : tree.size], tree.retrieve)
                elif self.sampling.acceptance == "exact":
                    nodes, root = accept_exact(row_tokens.cpu(), tree.children, row_logits, self.sampling,
                                               self.generator)  # fmt: skip
                else:
                    nodes, root = accept_typical(row_tokens, tree.retrieve, row_logits, self.sampling, self.generator)
                accepted.append((torch.as_tensor(nodes, device=self.device), root))  # (A_b+1,) root and candidates
        with record_function("mtp.cache"):
            self.slots = keep_accepted(self.cache, self.slots, [nodes for nodes, _ in accepted], prefix_lens)
        settled = []
        for b, (row, (nodes, root)) in enumerate(zip(self.rows, accepted, strict=True)):
            tree, row_tokens = trees[b], tokens[b]
            row.prefix_len, row.root, row.hidden = row.prefix_len + len(nodes), root, hidden[b, nodes[-1]]
            tokens_settled = row_tokens[nodes[1:]].tolist() + [root]
            if row.sequence is None:  # no lookup: nothing of it to count or to keep
                settled.append((tokens_settled, 0))
                continue
            settled.append((tokens_settled, int((tree.ranks[nodes] == LOOKUP).sum())))
            row.sequence = torch.cat([row.sequence, torch.tensor(tokens_settled)])
        return settled
