"""Measure what a drafter's trees accept, and size the tree to this machine: grow it from the heads' calibrated
rank accuracies, time a decoding step for each tree size on this device, keep the size with the highest expected
speedup, save it with the heads. With held-out answers (--data), prompt lookup's lengths are chosen with it, and
what every candidate tree and lookup accepts per step is saved too (`HeadsConfig.acceptance`): `mtp.load` chooses
among those on the machine it runs on, by that machine's step costs (`mtp.pacing`).

    python -m mtp.sizing --heads HEADS [--data TRAINING_DATA [--val-data ANSWERS]] [--device cpu] [--max-nodes 64]
        [--remeasure]

Expected tau (tokens per verification pass) of a tree is 1 (the bonus token) plus, over its candidate nodes,
the probability that the node's whole path is right, taken as the product of the rank accuracies along it
(heads treated as independent). At most one node per depth can be right, so this sum is the expected number
of accepted candidates. Expected speedup over plain decoding is tau(N) * step(1) / step(N), with step(N) the
measured time of a decoding step that verifies N tree tokens (step(1): the fastest plain one-token step, see
`measure_steps`).

With --data (the heads' training data, which decides the prompts they did not train on; --val-data: read these
answers to them, as training's data.val_data), decoding the base model's own answers to the held-out prompts is
simulated instead, step by step: at each root, the heads' tree accepts the true path as deep as it holds it
(teacher-forced guesses), prompt lookup (`mtp.lookup`) its right leading tokens, the step the longer of the two
plus the bonus token, and it costs step(N + lookup's tokens that are new nodes). Heads and lookup are measured
together on the same answers, so their overlap is counted once. For every tree size, the lookup lengths (tokens
after a match of 1, 2, 3 tokens) with the most tokens per second are searched, and the best pair is saved.
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from mtp.cli import user_errors
from mtp.costs import SIZES, machine_key, measure_steps, step_costs, timed, timed_sizes
from mtp.data import add_held_out_arguments, held_out
from mtp.decoding import Decoder
from mtp.folder import Drafter, load_with_base
from mtp.lookup import FULL, MAX_NGRAM, Lookup
from mtp.machine import measured
from mtp.pacing import Candidate, Plan
from mtp.sampling import GREEDY
from mtp.target import States, Target
from mtp.tree import DynamicTree, Path, Tree, grow_tree

LOOKUP_LENGTHS = tuple(range(FULL + 1))  # prompt-lookup tokens after a match that sizing chooses from
DYNAMIC_DEPTHS, DYNAMIC_TOP_K = (2, 3, 4, 5), (2, 3, 4)  # the dynamic trees sizing simulates
DYNAMIC_ANSWERS = 24  # distinct held-out answers they are simulated on (every root drafts a tree), beside static trees


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
        guesses = heads.path_guesses(
            out.last_hidden_state[0], features, ids.to(model.device), model.get_output_embeddings(), embed, top_k
        ).cpu()  # (K, T, k) fmt: skip
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
        states = States(out.last_hidden_state, out.hidden_states if layers else None)
        # as decoding would, a root grows no deeper than its room (the answer tokens after it, but the last); the
        # roots of one room at a time
        rooms = {p: min(plan.depth, left[p] - 1) for p in roots}
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


def measure_drafting(model, tokenizer, heads: Drafter, plans: list, context: int, steps: int = 6) -> list[float]:
    """Seconds the drafters take to propose one step's tree, for each plan (a static `Tree` or a `DynamicTree`),
    after a prompt of `context` random tokens: the median of `steps` proposals after a warm-up step."""
    prompt = torch.randint(len(tokenizer), (1, context), generator=torch.Generator().manual_seed(0))
    seconds = []
    for plan in plans:
        rows = Decoder(model, tokenizer, heads, plan).batch(GREEDY)
        rows.add(prompt)
        rows.step()
        spent = []
        for _ in range(steps):
            spent.append(timed(partial(rows.propose, Plan(plan)), model.device))
        seconds.append(sorted(spent)[len(spent) // 2])
    return seconds


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


def simulate(roots: dict[str, torch.Tensor], size: int, lengths: list[int], costs: list[float],
             heads: torch.Tensor | None = None):  # fmt: skip
    """(tokens, steps, seconds) of decoding the answers of `roots` as `decode` does, a step of n nodes costing
    costs[n - 1]."""
    tokens, _, _, nodes = decode(roots, size, lengths, heads)
    return tokens, len(nodes), float(torch.tensor(costs, dtype=torch.float64)[nodes - 1].sum())


def acceptance(roots: dict[str, torch.Tensor], size: int, lengths: list[int], depth: int) -> Candidate:
    """What the `size`-node tree (`depth` deep) with lookup `lengths` accepts per step on the answers of `roots`
    (see `decode`): the pacing candidate `mtp.load` weighs against this machine's step costs."""
    _, from_tree, from_lookup, nodes = decode(roots, size, lengths)
    shares = torch.bincount(nodes - size).double() / len(nodes)  # (E,) steps with size + e nodes
    return Candidate(size, tuple(lengths) if any(lengths) else (), float(from_tree.double().mean()),
                     float(from_lookup.double().mean()), tuple(shares.tolist()), depth)  # fmt: skip


def best_lookup(roots: dict[str, torch.Tensor], size: int, costs: list[float], heads=None) -> tuple:
    """The lookup lengths (one per match length, each from LOOKUP_LENGTHS) with the most tokens per second beside
    the `size`-node tree, by coordinate ascent from none, and their `simulate` figures (`heads`: as there)."""
    lengths = [0] * int(roots["match"].max().clamp(min=1))
    best = simulate(roots, size, lengths, costs, heads)
    for _ in range(2):
        for n in range(len(lengths)):
            for value in LOOKUP_LENGTHS:
                trial = lengths[:n] + [value] + lengths[n + 1 :]
                found = simulate(roots, size, trial, costs, heads)
                if found[0] / found[2] > best[0] / best[2]:
                    lengths, best = trial, found
    return lengths, best


def expected_speedups(heads_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, max_nodes: int = 64,
                      context: int = 256, remeasure: bool = False, held_out: list | None = None) -> dict:  # fmt: skip
    """Per tree size 1..max_nodes: expected tau, step seconds on this device (timed once, then cached in
    `$MTP_CACHE/step_seconds.json`) and expected speedup; `chosen` is the size with the highest speedup. With
    `held_out` (answers of the base model to prompts the heads did not train on, as (ids, mask, ...)), decoding
    them is simulated (`simulate`) for every size with the heads alone (`measured`) and beside the best lookup
    lengths (`lookup`), and the best of those chooses the size and `chosen_lookup`."""
    heads, model, tokenizer = load_with_base(heads_path, device=device, dtype=dtype)
    if heads.config.calibration is None:
        raise ValueError(
            f"{heads_path} has no calibration (rank accuracies): train with a validation split "
            f"(data.val_fraction > 0); the last validation run records them."
        )
    paths, expected = grow_tree(heads.config.calibration, max_nodes)
    key = machine_key(model, heads, context)
    name = f"{key} | sizes {timed_sizes(paths, 1)}"
    timed_costs = measured("step_seconds.json", name, lambda: measure_steps(model, tokenizer, heads, paths, context),
                           again=remeasure)  # fmt: skip
    costs = step_costs(timed_costs, len(expected) + max(LOOKUP_LENGTHS))
    speedups = [tau * costs[0] / cost for tau, cost in zip(expected, costs, strict=False)]
    table = {"size": list(range(1, len(expected) + 1)), "expected_tau": expected,
             "step_seconds": costs[: len(expected)], "expected_speedup": speedups,
             "chosen": max(range(len(speedups)), key=speedups.__getitem__) + 1,
             "paths": paths, "device": key, "chosen_lookup": []}  # fmt: skip
    if held_out is None:
        return table
    roots = held_out_roots(model, heads, paths, held_out, Lookup((max(LOOKUP_LENGTHS),) * MAX_NGRAM))
    table["measured"], table["lookup"] = [], []
    for size in table["size"]:
        tokens, steps, seconds = simulate(roots, size, [], costs)
        table["measured"].append({"tau": tokens / steps, "speedup": tokens * costs[0] / seconds})
        lengths, (tokens, steps, seconds) = best_lookup(roots, size, costs)
        table["lookup"].append({"lengths": lengths, "tau": tokens / steps, "speedup": tokens * costs[0] / seconds})
    best = max(table["lookup"], key=lambda row: row["speedup"])
    table["chosen"] = table["lookup"].index(best) + 1
    table["chosen_lookup"] = best["lengths"] if any(best["lengths"]) else []
    table["roots"] = {"count": len(roots["match"]), "matched": [float((roots["match"] == n).float().mean())
                      for n in range(1, MAX_NGRAM + 1)]}  # fmt: skip
    table["acceptance"] = []  # the candidates mtp.load weighs on the machine it runs on: per timed size, no
    for size in timed_sizes(paths, 1):  # lookup, the lookup that paid most here, and the longest
        depth = max(map(len, paths[: size - 1]), default=0)
        settings = {(), tuple(table["lookup"][size - 1]["lengths"]), (FULL,) * MAX_NGRAM}
        for lengths in sorted(settings):
            table["acceptance"].append(acceptance(roots, size, list(lengths), depth))
    table["dynamic"] = dynamic_trees(model, tokenizer, heads, paths, held_out, costs, context)
    return table


def spread(examples: list, count: int) -> list:
    """`count` of `examples` ((ids, mask, ...)) evenly spaced over those with distinct answers: held-out sets repeat
    short answers (the distilled ones begin with 24 greetings to "hello" and the like), which would fill a sample
    of their first few and say nothing of longer answers."""
    distinct = list({tuple(example[0][example[1].bool()].tolist()): example for example in examples}.values())
    step = max(len(distinct) / count, 1.0)
    return [distinct[int(i * step)] for i in range(min(count, len(distinct)))]


def dynamic_trees(model, tokenizer, heads: Drafter, paths: list[Path], examples: list, costs: list[float],
                  context: int) -> list[dict]:  # fmt: skip
    """Per timed size n > 1: the dynamic tree of n nodes (of DYNAMIC_DEPTHS x DYNAMIC_TOP_K) with the most tokens
    per second on DYNAMIC_ANSWERS of `examples` (`spread`), with and without the best lookup, beside the static
    n-node tree on the same answers. A dynamic step costs the static one's step (`costs`) with the static tree's
    drafting time replaced by its own (both timed)."""
    examples = spread(examples, DYNAMIC_ANSWERS)
    roots = held_out_roots(model, heads, paths, examples, Lookup((max(LOOKUP_LENGTHS),) * MAX_NGRAM))
    sizes = [size for size in timed_sizes(paths, 1) if size > 1]
    static = [Tree.from_paths(paths[: size - 1]) for size in timed_sizes(paths, 1)]
    static_drafting = step_costs(measure_drafting(model, tokenizer, heads, static, context), len(costs))
    depths = [depth for depth in DYNAMIC_DEPTHS if heads.max_depth is None or depth <= heads.max_depth]
    plans = [DynamicTree(max(sizes), depth, k) for depth in depths for k in DYNAMIC_TOP_K]
    drafting = measure_drafting(model, tokenizer, heads, plans, context)
    found = {size: [] for size in sizes}
    for plan, seconds in zip(plans, drafting, strict=True):
        accepts = grown_accepts(model, heads, examples, plan)  # (R, N)
        for size in sizes:
            extra = seconds - static_drafting[size - 1]  # drafting a dynamic step costs this more than a static one
            own = [cost + extra for cost in costs]
            tokens, steps, _ = simulate(roots, size, [], own, heads=accepts[:, size - 1])
            lengths, (with_tokens, with_steps, with_seconds) = best_lookup(roots, size, own, heads=accepts[:, size - 1])
            found[size].append({"plan": str(DynamicTree(size, plan.depth, plan.top_k)), "tau": tokens / steps,
                                "lookup_tau": with_tokens / with_steps, "lengths": lengths if any(lengths) else [],
                                "speedup": with_tokens * costs[0] / with_seconds, "drafting": seconds})  # fmt: skip
    rows = []
    for size in sizes:
        row = max(found[size], key=lambda trial: trial["speedup"])
        tokens, steps, _ = simulate(roots, size, [], costs)
        _, (with_tokens, with_steps, with_seconds) = best_lookup(roots, size, costs)
        rows.append(row | {"size": size, "static_tau": tokens / steps, "static_lookup_tau": with_tokens / with_steps,
                           "static_speedup": with_tokens * costs[0] / with_seconds})  # fmt: skip
    return rows


def size_tree(heads_path: str, **options) -> dict:
    """Save the tree and lookup with the highest expected speedup on this device into the heads' config, and with
    held-out answers what every candidate accepts (`HeadsConfig.acceptance`: `mtp.load` chooses among them by the
    step costs of the machine it runs on); options: those of `expected_speedups`. Returns the table."""
    table = expected_speedups(heads_path, **options)
    heads = Drafter.from_pretrained(heads_path)
    heads.config.tree = [list(path) for path in table["paths"][: table["chosen"] - 1]]
    heads.config.lookup = table["chosen_lookup"]
    heads.config.dynamic_tree = None
    if "acceptance" in table:  # without held-out answers, what was measured with them stays
        heads.config.acceptance = [candidate.as_dict() for candidate in table["acceptance"]]
    heads.save_config(heads_path)
    return table


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="heads folder; its config.json gets the chosen tree")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    parser.add_argument("--remeasure", action="store_true", help="time the steps again, even if cached")
    add_held_out_arguments(parser, required=False)
    args = parser.parse_args()
    base_model = Drafter.from_pretrained(args.heads).config.base_model
    examples = held_out(args, base_model).val_examples if args.data else None
    table = size_tree(args.heads, device=args.device, dtype=getattr(torch, args.dtype), max_nodes=args.max_nodes,
                      context=args.context, remeasure=args.remeasure, held_out=examples)  # fmt: skip
    simulated = "measured" in table
    print(f"{table['device']}\n  size  expected tau  step ms  expected speedup"
          + ("  held-out tau / speedup  with lookup: tau / speedup, lengths" if simulated else ""))  # fmt: skip
    columns = zip(*(table[k] for k in ("size", "expected_tau", "step_seconds", "expected_speedup")), strict=True)
    for n, tau, cost, speedup in columns:
        chosen = "  <- chosen" if n == table["chosen"] else ""
        if n in SIZES or chosen:
            row = f"  {n:4d}  {tau:12.2f}  {cost * 1e3:7.1f}  {speedup:16.2f}"
            if simulated:
                alone, both = table["measured"][n - 1], table["lookup"][n - 1]
                row += f"  {alone['tau']:14.2f} / {alone['speedup']:.2f}  {both['tau']:17.2f} / {both['speedup']:.2f}"
                row += f", {both['lengths']}"
            print(row + chosen)
    costs = dict(zip(table["size"], table["step_seconds"], strict=True))
    ratios = ", ".join(f"{n} nodes {costs[n] / costs[1]:.2f}x" for n in (2, 3, 4, 8) if n in costs)
    print(f"A step's cost against the fastest plain step ({costs[1] * 1e3:.1f} ms): {ratios}")
    if simulated:
        roots = table["roots"]
        shares = ", ".join(f"{n} tokens {share:.1%}" for n, share in enumerate(roots["matched"], 1))
        print(f"{roots['count']} held-out answer tokens as roots; lookup's longest match: {shares}")
        print(f"Dynamic trees on {DYNAMIC_ANSWERS} distinct held-out answers spread over them, against the static "
              "tree of as many nodes there (tau alone / with lookup, speedup with lookup):")  # fmt: skip
        for row in table["dynamic"]:
            print(f"  {row['size']:4d}  {row['plan']:>15}  tau {row['tau']:.2f} / {row['lookup_tau']:.2f}, "
                  f"{row['speedup']:.2f}x; static tau {row['static_tau']:.2f} / {row['static_lookup_tau']:.2f}, "
                  f"{row['static_speedup']:.2f}x")  # fmt: skip
    lookup = table["chosen_lookup"] or "no"
    saved = f" and what {len(table['acceptance'])} candidates accept" if simulated else ""
    print(f"Saved the {table['chosen']}-node tree, {lookup} lookup tokens{saved} to {args.heads}/config.json")


if __name__ == "__main__":
    main()
