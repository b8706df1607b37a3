"""What a draft vocabulary buys and costs, in one run: the share of the training targets that the N most frequent
target tokens cover; a decoding step's time over a grown tree against a plain step; and tau on MT-Bench first
turns, for the whole vocabulary and each N (the heads' guesses restricted to those N tokens).

    python benchmarks/draft_vocab.py --drafter heads/smollm2-135m-instruct --data data/distilled/sharegpt-greedy-256
"""

import argparse

import torch

import mtp
from mtp.decoding.costs import measure_steps
from mtp.decoding.tree import grow_tree
from mtp.training.data import DrafterDataModule
from mtp.training.rows import read_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", "--heads", required=True)
    parser.add_argument("--data", required=True, help="training data whose target tokens make the draft vocabulary")
    parser.add_argument("--sizes", default="4096,8192,16384")
    parser.add_argument("--tree", type=int, default=4, help="tree size (grown from the heads' calibration)")
    parser.add_argument("--questions", default="data/mt_bench.jsonl")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    decoder = mtp.load(args.drafter, tree=str(args.tree))
    heads, model = decoder.drafter, decoder.base_model
    data = DrafterDataModule(args.data, heads.config.base_model, val_fraction=0)
    data.setup("fit")
    targets = torch.cat([ids[mask] for ids, mask in data.train_examples])
    counts = torch.bincount(targets, minlength=heads.config.vocab_size).sort(descending=True)  # (V,)
    questions = [[{"role": "user", "content": row["turns"][0]}] for row in read_rows(args.questions)[::10]]
    paths = grow_tree(heads.config.calibration, args.tree)[0]
    print(f"{len(targets)} training targets; tree of {args.tree} nodes; {len(questions[: args.limit])} questions")
    print("| vocabulary | targets covered | step ms (tree) | plain step ms | ratio | tau |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for size in [None, *map(int, args.sizes.split(","))]:
        heads.config.draft_vocab = None if size is None else counts.indices[:size].tolist()
        covered = 1.0 if size is None else float(counts.values[:size].sum() / counts.values.sum())
        costs = measure_steps(model, decoder.tokenizer, heads, paths, context=256)  # sizes 1 .. the tree's
        plain, tree = costs[0], costs[-1]
        tokens = passes = 0
        for messages in questions[: args.limit]:
            result = decoder.generate(messages, max_new_tokens=args.max_new_tokens)
            tokens, passes = tokens + len(result.token_ids), passes + result.forward_passes
        name = "whole" if size is None else str(size)
        print(
            f"| {name} | {covered:.1%} | {tree * 1e3:.1f} | {plain * 1e3:.1f} | {tree / plain:.2f} | "
            f"{tokens / passes:.2f} |"
        )


if __name__ == "__main__":
    main()
