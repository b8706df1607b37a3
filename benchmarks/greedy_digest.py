"""The greedy answers of the MT-Bench first turns as one digest: a change to the decoder that should not change
what it decodes (a refactor, a faster step) leaves the digest as it was.

    python benchmarks/greedy_digest.py --drafter heads/smollm2-135m-instruct --questions data/mt_bench.jsonl \
        --check benchmarks/mt_bench_greedy.sha256

Prints the SHA-256 of every answer's token ids (JSON, in question order) and writes the answers to --out, to find
the first that differs when the digest does. With --check FILE: exits 1 unless the digest equals the one in FILE.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

from tqdm import tqdm

import mtp
from mtp.decoding.tree import TREE_HELP
from mtp.tools.cli import user_errors
from mtp.training.rows import read_rows


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", "--heads", required=True)
    parser.add_argument("--questions", required=True, help="JSON lines with `turns` (first turn used)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", help=TREE_HELP)
    parser.add_argument("--out", default="runs/greedy_digest.json", help="the answers' token ids, JSON")
    parser.add_argument("--check", type=Path, help="a file holding the expected digest")
    args = parser.parse_args()
    decoder = mtp.load(args.drafter, tree=args.tree)
    answers = []
    for row in tqdm(read_rows(args.questions), desc="answers", unit="question"):
        result = decoder.generate([{"role": "user", "content": row["turns"][0]}], max_new_tokens=args.max_new_tokens)
        answers.append(result.token_ids)
    digest = hashlib.sha256(json.dumps(answers).encode()).hexdigest()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(answers))
    print(f"{digest}  {len(answers)} answers, {sum(map(len, answers))} tokens")
    if args.check is not None:
        expected = args.check.read_text().split()[0]
        if digest != expected:
            print(f"differs from {args.check} ({expected}): the answers are in {args.out}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
