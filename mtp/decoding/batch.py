"""Rows in flight: B prompts decoded together, one verification pass of the base model over every row's tree per
step, each row accepting its own number of tokens. A single prompt is the batch of one.

A row joins with a prefill of its own prompt alone (its cache appended as a new row, see `mtp.decoding.cache`), so its
logits are exactly those of the prompt decoded alone and a waiting prompt can take the place of a finished one
at once; a row leaves as soon as its caller says it is done, and costs nothing after.
"""

import sys
from dataclasses import dataclass, field, replace

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from mtp.decoding import acceptance
from mtp.decoding.cache import append_rows, grouped_keys, keep_accepted, keep_rows, tree_attention_mask
from mtp.decoding.compiled import CompiledPass
from mtp.decoding.pacing import Pacer, Plan, Skill
from mtp.decoding.proposer import Proposer
from mtp.decoding.sampling import Sampling
from mtp.decoding.target import PassStates, Target
from mtp.decoding.tree import Tree


@dataclass
class Row:
    """One prompt of the batch."""

    prefix_len: int
    """Positions cached: the prompt and the tokens accepted so far. The next tree's root sits here."""
    root: int
    """The last settled token, not cached yet: the root of the next tree."""
    max_length: int
    """The row ends at this length (prompt and new tokens): no node is placed at max_length - 1 or later."""
    tree_skill: Skill = field(default_factory=Skill)
    lookup_skill: Skill = field(default_factory=Skill)
    """How many times the average the tree's and lookup's candidates are accepted in this row of late (see
    `mtp.decoding.pacing`)."""
    generator: torch.Generator | None = None
    """The row's own random generator when sampling: its draws do not depend on the other rows."""

    @property
    def room(self) -> int:
        """How deep a tree may grow below the root: a node at max_length - 1 would be past the end, and the last
        token's own guess would only repeat the bonus token of its parent."""
        return max(self.max_length - 2 - self.prefix_len, 0)


class Batch:
    """The rows decoded together: the target model's shared cache, the drafters' states (`proposers`, each
    step in turn: see `mtp.decoding.proposer`), what each step verifies (`pacer`: see `mtp.decoding.pacing`) and
    the sampling settings (each row draws from its own generator, seeded by its number: its tokens do not depend on
    the other rows). With `compiled`, a lone row's passes run compiled over its static cache
    (`mtp.decoding.compiled`); when a second row joins, the cache becomes a dynamic one and passes run eagerly."""

    def __init__(
        self,
        target: Target,
        proposers: list[Proposer],
        pacer: Pacer,
        sampling: Sampling,
        compiled: CompiledPass | None = None,
    ):
        self.target, self.proposers, self.pacer, self.compiled = target, proposers, pacer, compiled
        self.sampling, self.added = sampling, 0  # rows added so far: the next one's default number
        self.device = target.device
        self.rows: list[Row] = []
        self.cache, self.slots = DynamicCache(), None  # slots (B, T): see mtp.decoding.cache
        self.every_layer = any(proposer.layers for proposer in proposers)  # a drafter reads more than the last states
        self.root = Tree.from_paths([]).to(self.device)  # every step's tree before the drafters propose

    @torch.no_grad()
    def add(self, input_ids: torch.Tensor, max_length: int | None = None, number: int | None = None) -> int:
        """Prefill the prompt `input_ids` (1, T) alone and add it as the last row; returns its first new token.
        `max_length`: the row ends at this length (default: the model's context window). `number`: when sampling,
        the row draws from a generator seeded from the sampling seed and `number` (default: the rows added
        before it)."""
        number, self.added = self.added if number is None else number, self.added + 1
        cache = DynamicCache()  # every position on every layer: see mtp.decoding.cache
        states = self.target.run(self.every_layer, input_ids=input_ids.to(self.device), cache=cache)
        logits = self.target.logits(states.last[0, -1])  # (V,)
        generator = None if self.sampling.greedy else self.sampling.generator(number)
        if generator is None:
            root = int(logits.argmax())
        else:
            root = acceptance.draw(self.sampling.probabilities(logits).cpu(), generator)
        slots = torch.arange(input_ids.shape[1], device=self.device)[None]  # (1, T)
        max_length = max_length or self.target.context or sys.maxsize
        if self.rows:
            if self.static:  # a second row: eager passes over a dynamic cache from here on
                self.cache = self.leave_static()
            self.slots = append_rows(self.cache, self.slots, cache, slots)
        elif self.compiled is not None and self.compiled.claim(self, input_ids.shape[1]):
            self.cache, self.slots = self.compiled.load(cache), slots
        else:
            self.cache, self.slots = cache, slots
        for proposer in self.proposers:
            proposer.add(input_ids[0], states, root)
        self.rows.append(Row(input_ids.shape[1], root, max_length, generator=generator))
        return root

    @property
    def static(self) -> bool:
        """Whether the rows' cache is the compiled pass's static one (a lone row that fits it)."""
        return self.compiled is not None and self.cache is self.compiled.cache

    def leave_static(self) -> DynamicCache:
        """The rows' cache moved off the compiled pass's static one (for eager steps from here on), which is freed."""
        cache = self.compiled.unload(self.slots.shape[1])
        self.release()
        return cache

    def release(self) -> None:
        """Free the compiled pass's static cache, if this batch holds it, for the next batch."""
        if self.compiled is not None:
            self.compiled.release(self)

    def keep(self, rows: list[bool]) -> None:
        """Keep the rows marked True, in order; the others leave the batch."""
        if all(rows):
            return
        self.rows = [row for row, kept in zip(self.rows, rows, strict=True) if kept]
        for proposer in self.proposers:
            proposer.keep(rows)
        if self.rows:
            self.slots = keep_rows(self.cache, self.slots, torch.tensor(rows, device=self.device))
        else:
            self.cache, self.slots = DynamicCache(), None
            self.release()

    def propose(self, plan: Plan) -> tuple[list[Tree], list[torch.Tensor]]:
        """Each row's tree and its tokens (N_b+1,) by `plan`: every drafter's candidates in turn, none past the
        row's room. On the static cache, a grafting drafter's (prompt lookup's) nodes past the largest compiled
        pass are dropped: a pass over more nodes runs eagerly, which costs about three compiled ones."""
        trees = [self.root] * len(self.rows)
        tokens = [torch.tensor([row.root], device=self.device) for row in self.rows]
        rooms = [row.room for row in self.rows]
        for source, proposer in enumerate(self.proposers):
            sizes = [tree.size for tree in trees]
            trees, tokens = proposer.propose(plan, trees, tokens, rooms, source)
            if proposer.grafts and self.static:  # (grafted nodes come last)
                most = [max(size, self.compiled.buckets[-1]) for size in sizes]
                trees = [tree.head(n) for tree, n in zip(trees, most, strict=True)]
                tokens = [row[:n] for row, n in zip(tokens, most, strict=True)]
        return trees, tokens

    @torch.no_grad()
    def step(self) -> list[tuple[list[int], dict[str, int]]]:
        """One step over every row: the drafters propose each row's tree by the step's plan, one pass of the base
        model verifies every tree, each row accepts what the base model would have produced, and the cache and the
        drafters commit it. Per row: the tokens it settles (the accepted candidates and the bonus token) and how
        many of its accepted candidates each drafter proposed, by name."""
        plan = self.pacer.plan(self.rows)
        prefix_lens = torch.tensor([row.prefix_len for row in self.rows], device=self.device)  # (B,) the roots' places
        with record_function("mtp.candidates"):  # the drafters' guesses laid out on each row's tree
            trees, tokens = self.propose(plan)
        states = self.verify(trees, tokens, prefix_lens)
        with record_function("mtp.accept"):
            nodes, settled = self.accept(trees, tokens, states)
        return self.commit(plan, trees, states, nodes, settled, prefix_lens)

    def verify(self, trees: list[Tree], tokens: list[torch.Tensor], prefix_lens: torch.Tensor) -> PassStates:
        """One pass of the base model over every row's tree after its cache, each node at its depth past its row's
        root (at `prefix_lens` (B,)) and seeing its ancestors only; rows with smaller trees are padded with nodes
        seen by none."""
        with record_function("mtp.verify"):
            size = max(tree.size for tree in trees)
            batch = torch.zeros(len(trees), size, dtype=torch.long, device=self.device)  # (B, Q) tokens
            depths = torch.zeros_like(batch)  # (B, Q)
            mask = torch.eye(size, dtype=torch.bool, device=self.device).repeat(len(trees), 1, 1)  # (B, Q, Q)
            for b, (tree, row_tokens) in enumerate(zip(trees, tokens, strict=True)):
                batch[b, : tree.size], depths[b, : tree.size] = row_tokens, tree.depths
                mask[b, : tree.size, : tree.size] = tree.mask
            positions = prefix_lens[:, None] + depths  # (B, Q)
            if self.static and not self.compiled.holds(self.slots.shape[1], size):  # past the static cache's end
                self.compiled.outgrown(self.slots.shape[1])
                self.cache = self.leave_static()
            if self.static:
                return self.compiled.run(batch, positions, mask, self.slots, self.every_layer)
            attention = tree_attention_mask(mask, positions, self.slots, self.target.windows, self.target.dtype)
            with grouped_keys(self.device.type == "cpu" and size > 1):
                states = self.target.run(
                    self.every_layer,
                    input_ids=batch,
                    position_ids=positions,
                    attention_mask=attention,
                    cache=self.cache,
                )
            return replace(states, logits=self.target.logits(states.last))

    def accept(self, trees: list[Tree], tokens: list[torch.Tensor], states: PassStates):
        """Each row's accepted nodes (A_b+1,), root first, by the sampling settings' rule (`mtp.decoding.acceptance`) on
        the base model's logits after each node of the pass `states`, and the tokens they settle (the accepted
        candidates, then the bonus token)."""
        logits = states.logits  # (B, Q, V) the base model's next-token logits after each node
        accepted = [
            acceptance.accept(tree, row_tokens, logits[b, : tree.size], self.sampling, row.generator)
            for b, (tree, row_tokens, row) in enumerate(zip(trees, tokens, self.rows, strict=True))
        ]
        nodes = [torch.as_tensor(row_nodes, device=self.device) for row_nodes, _ in accepted]  # (A_b+1,) each
        settled = [
            row_tokens[row_nodes[1:]].tolist() + [bonus]
            for row_tokens, row_nodes, (_, bonus) in zip(tokens, nodes, accepted, strict=True)
        ]
        return nodes, settled

    def commit(
        self,
        plan: Plan,
        trees: list[Tree],
        states: PassStates,
        nodes: list[torch.Tensor],
        settled: list,
        prefix_lens: torch.Tensor,
    ):
        """Keep each row's accepted nodes in the cache (the rest dropped) and hand them to the drafters; each row
        moves past them and its drafters' skills follow (`Pacer.update`). Returns `step`'s results."""
        with record_function("mtp.cache"):
            self.slots = keep_accepted(self.cache, self.slots, nodes, prefix_lens)
        with record_function("mtp.drafters"):
            for proposer in self.proposers:
                proposer.accept(states, nodes, settled)
        results = []
        for row, tree, row_nodes, row_settled in zip(self.rows, trees, nodes, settled, strict=True):
            row.prefix_len, row.root = row.prefix_len + len(row_nodes), row_settled[-1]
            sources = tree.sources[row_nodes[1:]].tolist()
            counts = [sources.count(i) for i in range(len(self.proposers))]  # accepted, per proposer
            grafted = sum(count for count, p in zip(counts, self.proposers, strict=True) if p.grafts)
            self.pacer.update(row, plan, len(sources) - grafted, grafted)
            results.append((row_settled, {p.name: count for p, count in zip(self.proposers, counts, strict=True)}))
        return results
