"""The feature-level drafter (`mtp.drafters.eagle.Eagle`) decoding: its proposer over the rows of a batch."""

import torch
from torch import nn
from torch.nn import functional as F

from mtp.decoding.cache import select_rows, stack_rows
from mtp.decoding.proposer import TreeProposer
from mtp.decoding.target import Target


class EagleProposer(TreeProposer):
    """The feature-level drafter over the rows of a batch, with its own cache of every row's true entries (the
    prompt and the accepted tokens, each with the base model's feature before it). A step drafts the tree level by
    level from each row's root entry; the entries of the tree's nodes are dropped after it, and the accepted ones
    enter the cache with the base model's features instead. Rows share the cache as the base's rows do theirs: a
    slot that holds no entry of a row is masked (`seen`)."""

    name = "eagle"

    def __init__(self, eagle: nn.Module, target: Target, cut: dict):
        super().__init__(target, cut)
        self.eagle, self.layers = eagle, eagle.config.feature_layers
        self.keys = self.values = self.seen = None  # (B, G, S, d) rotated keys, values; (B, S) bool
        self.state = []  # per row, (H,) the output of its root's entry: it scores the root's children
        self.positions = []  # per row, its root's position
        self.outputs = self.drafted = None  # this step's drafted entries: see `expand`

    def _run(self, feature, embedding, positions, past, mask):
        """The layer over entries feature, embedding (B, Q, H) at positions (B, Q), after `past`, seeing `mask`."""
        return self.eagle.midlayer(feature, embedding, self.eagle.rotary(feature, positions), past, mask)

    def _prefill(self, input_ids, states, root):
        """The layer over a prompt's entries (entry j: the feature at j and token j + 1, the root last): their
        outputs (1, T, H), keys and values (1, G, T, d)."""
        device = self.target.device
        ids = torch.cat([input_ids.to(device)[1:], torch.tensor([root], device=device)])  # (T,) entry j: token j
        length = len(ids)
        feature = self.eagle.fc(states.features(self.layers, 0, slice(None)))[None]  # (1, T, H)
        positions = torch.arange(1, length + 1, device=device)[None]  # (1, T)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]  # (1, 1, T, T)
        return self._run(feature, self.target.embed(ids)[None], positions, None, causal)

    def add(self, input_ids, states, root):
        out, (keys, values) = self._prefill(input_ids, states, root)
        length = out.shape[1]
        seen = torch.ones(1, length, dtype=torch.bool, device=out.device)
        if self.keys is None:
            self.keys, self.values, self.seen = keys, values, seen
        else:  # the shorter of the old rows and the new one padded with unseen slots
            size = max(self.keys.shape[2], length)
            self.keys, self.values = stack_rows([self.keys, self.values], [keys, values])
            self.seen = torch.cat([F.pad(self.seen, (0, size - self.seen.shape[1])), F.pad(seen, (0, size - length))])
        self.state.append(out[0, -1])
        self.positions.append(length)

    def at_roots(self, input_ids, states, roots):
        """One prefill of the whole sequence: the row at root p sees its first p entries (an empty batch only)."""
        if self.keys is not None:
            raise ValueError("at_roots starts a batch: keep no rows before it.")
        length = len(input_ids) - 1  # entry p - 1 holds the root p
        out, (keys, values) = self._prefill(input_ids[:-1], states.prefix(length), int(input_ids[-1]))
        at = torch.tensor(roots, device=out.device)  # (B,)
        self.keys, self.values = keys.expand(len(roots), -1, -1, -1), values.expand(len(roots), -1, -1, -1)
        self.seen = torch.arange(out.shape[1], device=out.device)[None] < at[:, None]  # (B, S)
        self.state, self.positions = list(out[0, at - 1]), list(roots)

    def expand(self, draft, nodes, depth, k):
        batch, count = nodes.shape
        if depth == 1:  # a new step: the root's entry is cached; the drafted ones of the last step are gone
            outputs = torch.stack(self.state)[:, None]  # (B, 1, H)
            self.outputs, self.drafted = outputs, None  # each node's entry's output; (node ids, keys, values)
        else:  # the entries of `nodes`: each reads its parent's output and its own token
            size, hidden = draft.tokens.shape[1], self.outputs.shape[-1]
            self.outputs = F.pad(self.outputs, (0, 0, 0, size - self.outputs.shape[1]))  # (B, M, H)
            parents = draft.parents.gather(1, nodes)  # (B, P)
            feature = self.outputs.gather(1, parents[..., None].expand(-1, -1, hidden))  # (B, P, H)
            # (B, 1, P, S + R + P): the row's true entries (its root's included), its drafted ancestors', itself
            seen = [self.seen[:, None].expand(-1, count, -1)]
            past = self.keys, self.values
            if self.drafted is not None:
                ran, keys, values = self.drafted  # (B, R), (B, G, R, d) twice
                lineage = draft.ancestors.gather(1, nodes[..., None].expand(-1, -1, size))  # (B, P, M)
                seen.append(lineage.gather(2, ran[:, None].expand(-1, count, -1)))  # (B, P, R)
                past = torch.cat([self.keys, keys], 2), torch.cat([self.values, values], 2)
            seen.append(torch.eye(count, dtype=torch.bool, device=nodes.device).expand(batch, -1, -1))
            positions = (torch.tensor(self.positions, device=nodes.device)[:, None] + depth - 1).expand(-1, count)
            embedding = self.target.embed(draft.tokens.gather(1, nodes))  # (B, P, H)
            outputs, (keys, values) = self._run(feature, embedding, positions, past, torch.cat(seen, -1)[:, None])
            self.outputs = self.outputs.scatter(1, nodes[..., None].expand(-1, -1, hidden), outputs)
            if self.drafted is not None:
                keys, values = torch.cat([self.drafted[1], keys], 2), torch.cat([self.drafted[2], values], 2)
                nodes = torch.cat([self.drafted[0], nodes], 1)
            self.drafted = nodes, keys, values
        logits = self.eagle.logits(outputs, self.target.lm_head)  # (B, P, D)
        logp, best = logits.float().log_softmax(-1).topk(k, dim=-1)
        return self.eagle.draft_ids[best], logp

    def accept(self, states, nodes, settled):
        device = self.target.device
        counts = torch.tensor([len(row_nodes) for row_nodes in nodes], device=device)  # (B,) A_b + 1
        most = int(counts.max())
        features = [states.features(self.layers, b, row_nodes) for b, row_nodes in enumerate(nodes)]
        feature = self.eagle.fc(nn.utils.rnn.pad_sequence(features, batch_first=True))  # (B, M, H)
        tokens = nn.utils.rnn.pad_sequence([torch.tensor(row, device=device) for row in settled], batch_first=True)
        valid = torch.arange(most, device=device)[None] < counts[:, None]  # (B, M)
        causal = torch.ones(most, most, dtype=torch.bool, device=device).tril() & valid[:, None]  # (B, M, M)
        causal |= torch.eye(most, dtype=torch.bool, device=device)  # a padding entry sees itself: no empty row
        seen = torch.cat([self.seen[:, None].expand(-1, most, -1), causal], -1)[:, None]  # (B, 1, M, S+M)
        positions = torch.tensor(self.positions, device=device)[:, None] + 1 + torch.arange(most, device=device)
        out, (keys, values) = self._run(feature, self.target.embed(tokens), positions, (self.keys, self.values), seen)
        self.keys, self.values = torch.cat([self.keys, keys], 2), torch.cat([self.values, values], 2)
        self.seen = torch.cat([self.seen, valid], 1)
        self.state = [out[b, count - 1] for b, count in enumerate(counts.tolist())]
        self.positions = [position + count for position, count in zip(self.positions, counts.tolist(), strict=True)]

    def keep(self, rows):
        self.state = [state for state, k in zip(self.state, rows, strict=True) if k]
        self.positions = [position for position, k in zip(self.positions, rows, strict=True) if k]
        if not self.state:
            self.keys = self.values = self.seen = None
            return
        rows = torch.tensor(rows, device=self.target.device)
        filled = self.seen[rows].any(0)  # (S,) slots some kept row still sees
        self.keys, self.values = select_rows([self.keys, self.values], rows, filled)
        self.seen = self.seen[rows][:, filled]
