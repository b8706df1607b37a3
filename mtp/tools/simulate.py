"""Decoding held-out answers simulated, step by step, for `mtp.tools.sizing`: at each answer token taken as a root,
what the drafter's tree holds of the true continuation (teacher-forced guesses) and what prompt lookup's match
proposes; from those, the tokens, steps and seconds of decoding the answers with any tree size and lookup lengths,
and what each accepts per step (`mtp.decoding.pacing.Candidate`)."""

import torch
import torch.nn.functional as F

from mtp.decoding.lookup import FULL_REACH, Lookup
from mtp.decoding.pacing import Candidate, Plan
from mtp.decoding.target import PassStates, Target
from mtp.decoding.tree import DynamicTree, Path
from mtp.drafters.contract import Drafter
from mtp.linears import proposing

LOOKUP_LENGTHS = tuple(range(FULL_REACH + 1))  # prompt-lookup tokens after a match that sizing chooses from


def answer_roots(mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """For one example's answer `mask` (T,): the answer tokens that follow each position, in one run, and the
    roots, answer tokens that another follows (a step after the last one would be past the answer; the root's
    parent holds the drafter's input)."""
    left = [0] * len(mask)
    for t in range(len(mask) - 2, -1, -1):
        left[t] = left[t + 1] + 1 if mask[t + 1] else 0
    return left, [p for p in mask.nonzero()[:, 0].tolist() if p > 0 and left[p]]


@torch.no_grad()
def held_out_roots(model, heads: Drafter, paths: list[Path], examples: list, lookup: Lookup) -> dict[str, torch.Tensor]:
    """Every answer token of `examples` ((ids, mask, ...): the base model's own answers to prompts the heads did not
    train on) taken as a decoding step's root, with what a step there can accept, against the answer's own next
    tokens. Rows, roots of one answer consecutive: `left`, answer tokens after the root; `order[:, d]`, the place
    in `paths` (grow_tree's order) of the path of the true tokens' ranks down to depth d + 1 (len(paths) once the
    heads' guesses miss; teacher-forced, the heads that read the path read the true one); `match`, the length of
    lookup's match (0: none); `chain`, the number of tokens it proposes after it, at most `lookup.reach`;
    `right`, how many of them lead right."""
    place, num_heads = {path: i for i, path in enumerate(paths)}, heads.config.num_heads
    top_k = 1 + max((max(path) for path in paths), default=0)
    backbone, embed = model.get_decoder(), model.get_input_embeddings()
    rows = {name: [] for name in ("left", "order", "match", "chain", "right")}
    for ids, mask, *_ in examples:
        left, roots = answer_roots(mask)
        layers = heads.config.feature_layers
        out = backbone(input_ids=ids[None].to(model.device), output_hidden_states=bool(layers))
        features = torch.cat([out.hidden_states[i][0] for i in layers], -1) if layers else None  # (T, F)
        with proposing():  # the guesses as decoding drafts them
            guesses = heads.path_guesses(
                out.last_hidden_state[0], features, ids.to(model.device), model.get_output_embeddings(), embed, top_k
            ).cpu()  # (K, T, k)
        for p in roots:
            path, order = (), []
            for d in range(min(num_heads, left[p])):  # head d guesses the token d + 1 after the root
                hit = (guesses[d, p - 1] == ids[p + 1 + d]).nonzero()[:, 0]  # the true token's rank, if in the top k
                if not len(hit) or (path := path + (int(hit[0]),)) not in place:
                    break
                order.append(place[path])
            n, chain = lookup.match(ids[: p + 1])
            truth = ids[p + 1 : p + 1 + left[p]].tolist()
            right = next((i for i, (a, b) in enumerate(zip(chain, truth, strict=False)) if a != b), None)
            right = min(len(chain), len(truth)) if right is None else right
            order += [len(paths)] * (num_heads - len(order))
            for name, value in zip(rows, (left[p], order, n, len(chain), right), strict=True):
                rows[name].append(value)
    if not rows["left"]:
        raise ValueError("The held-out data has no answer tokens: give chats with assistant answers.")
    return {name: torch.tensor(values) for name, values in rows.items()}


@torch.no_grad()
def grown_accepts(model, heads: Drafter, examples: list, plan: DynamicTree, chunk: int = 32) -> torch.Tensor:
    """At every root of `held_out_roots` (in its order), the candidates that the tree `plan` grown there by the
    drafter accepts, the answer's own next tokens being the truth, with 1 .. plan.nodes nodes: (R, plan.nodes)
    (a grown tree of n nodes is the n most probable of the draft: see `DynamicTree`)."""
    target, layers = Target(model), heads.config.feature_layers
    proposer, step = heads.proposer(target, {}), Plan(plan)
    found = []
    for ids, mask, *_ in examples:
        left, roots = answer_roots(mask)
        ids = ids.to(target.device)
        out = target.backbone(input_ids=ids[None], output_hidden_states=bool(layers))
        states = PassStates(out.last_hidden_state, out.hidden_states if layers else None)
        # as decoding would, a root grows no deeper than its room (the answer tokens after it, but the last); the
        # roots of one room at a time
        rooms = {p: min(plan.deepest, left[p] - 1) for p in roots}
        parts = [[p for p in roots if rooms[p] == room] for room in sorted(set(rooms.values()))]
        parts = [part[start : start + chunk] for part in parts for start in range(0, len(part), chunk)]
        grown = {}
        for part in parts:
            proposer.at_roots(ids, states, part)
            firsts = [ids[p : p + 1] for p in part]  # each row's root token
            trees, tokens = proposer.propose(step, None, firsts, [rooms[part[0]]] * len(part), 0)
            proposer.keep([False] * len(part))
            grown |= {p: (tree, row_tokens) for p, tree, row_tokens in zip(part, trees, tokens, strict=True)}
        for p in roots:
            tree, row_tokens = grown[p]
            truth, values = ids[p + 1 : p + 1 + left[p]].tolist(), row_tokens.tolist()
            depths, right = tree.depths.tolist(), [True]  # right: the node's whole path is the truth
            for node, parent in enumerate(tree.parents.tolist()[1:], 1):
                depth = depths[node]
                right.append(right[parent] and depth <= len(truth) and values[node] == truth[depth - 1])
            order = tree.scores.sort(descending=True, stable=True).indices  # (N,) root first, parents first
            reached = (torch.tensor(right) * tree.depths.cpu())[order.cpu()].cummax(0).values  # (N,)
            found.append(F.pad(reached, (0, plan.nodes - len(reached)), value=int(reached[-1])))
    return torch.stack(found)


def decode(roots: dict[str, torch.Tensor], size: int, lengths: list[int], heads: torch.Tensor | None = None):
    """Decoding the answers of `roots` (see `held_out_roots`) with the tree of the first size - 1 paths and lookup
    of `lengths` (lengths[n - 1] tokens after a match of n): a step accepts the longer of the heads' right path and
    lookup's right tokens, plus the bonus token, which is the next step's root, and verifies size + the lookup
    tokens that do not repeat the heads' right path. `heads`: instead of the static tree's, the candidates the
    drafter's tree accepts at each root (R,), such as a dynamic tree's (`grown_accepts`). Returns the answer
    tokens, and per step taken (S,): the candidates accepted from the tree, those from lookup past them, and the
    nodes verified."""
    cap = torch.tensor([0, *lengths] + [0] * int(roots["match"].max()))[roots["match"]]  # no length: none
    heads = (roots["order"] < size - 1).sum(1) if heads is None else heads
    lookup = roots["right"].clamp(max=cap)
    # the next root: after the accepted tokens and the bonus one, or the next answer's first once none is left
    advance = (torch.maximum(heads, lookup) + 1).clamp(max=roots["left"])
    nodes = size + roots["chain"].clamp(max=cap) - torch.minimum(heads, lookup)
    visited, root, steps = [], 0, advance.tolist()
    while root < len(steps):
        visited.append(root)
        root += steps[root]
    accepted = advance[visited] - 1  # (S,) clamped at the answer's end
    from_tree = torch.minimum(heads[visited], accepted)
    return len(steps), from_tree, accepted - from_tree, nodes[visited]


def simulate(
    roots: dict[str, torch.Tensor], size: int, lengths: list[int], costs: list[float], heads: torch.Tensor | None = None
):
    """(tokens, steps, seconds) of decoding the answers of `roots` as `decode` does, a step of n nodes costing
    costs[n - 1]."""
    tokens, _, _, nodes = decode(roots, size, lengths, heads)
    return tokens, len(nodes), float(torch.tensor(costs, dtype=torch.float64)[nodes - 1].sum())


def acceptance(roots: dict[str, torch.Tensor], size: int, lengths: list[int], depth: int) -> Candidate:
    """What the `size`-node tree (`depth` deep) with lookup `lengths` accepts per step on the answers of `roots`
    (see `decode`): the pacing candidate `mtp.load` weighs against this machine's step costs."""
    _, from_tree, from_lookup, nodes = decode(roots, size, lengths)
    shares = torch.bincount(nodes - size).double() / len(nodes)  # (E,) steps with size + e nodes
    return Candidate(
        size,
        tuple(lengths) if any(lengths) else (),
        float(from_tree.double().mean()),
        float(from_lookup.double().mean()),
        tuple(shares.tolist()),
        depth,
    )


def best_lookup(
    roots: dict[str, torch.Tensor], size: int, costs: list[float], heads=None, most: int | None = None
) -> tuple:
    """The lookup lengths (one per match length, each from LOOKUP_LENGTHS, at most `most`) with the most tokens per
    second beside the `size`-node tree, by coordinate ascent from none, and their `simulate` figures (`heads`: as
    there)."""
    lengths = [0] * int(roots["match"].max().clamp(min=1))
    best = simulate(roots, size, lengths, costs, heads)
    for _ in range(2):
        for n in range(len(lengths)):
            for value in LOOKUP_LENGTHS[: None if most is None else most + 1]:
                trial = lengths[:n] + [value] + lengths[n + 1 :]
                found = simulate(roots, size, trial, costs, heads)
                if found[0] / found[2] > best[0] / best[2]:
                    lengths, best = trial, found
    return lengths, best


def evenly_spaced(examples: list, count: int) -> list:
    """`count` of `examples` ((ids, mask, ...)) evenly spaced over those with distinct answers: held-out sets repeat
    short answers (the distilled ones begin with 24 greetings to "hello" and the like), which would fill a sample
    of their first few and say nothing of longer answers."""
    distinct = list({tuple(example[0][example[1].bool()].tolist()): example for example in examples}.values())
    step = max(len(distinct) / count, 1.0)
    return [distinct[int(i * step)] for i in range(min(count, len(distinct)))]
