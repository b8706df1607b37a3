"""Build data/copy_heavy.jsonl: a copy-heavy evaluation set from training-side material, never a benchmark's
questions. It keeps the ShareGPT prompts of data/sharegpt_prompts.json that no distilled answer was trained on
(longer than 256 tokens: the distilled folders hold the prompts of at most 256) and at most 1,024 tokens, that
ask to summarise, rewrite, fix or translate a text they contain (the verb near their start or end), with the
category its first such verb names.

    python scripts/make_copy_heavy.py
"""

import json
import re
from pathlib import Path

from mtp.base import load_tokenizer

DATA = Path(__file__).resolve().parent.parent / "data"
CATEGORIES = {
    "summarise": r"summari[sz]e|summary",
    "rewrite": r"rewrite|re-write|rephrase|paraphrase|simplify|shorten|revise",
    "fix": r"proofread|correct|fix|edit|improve",
    "translate": r"translate",
}
VERB = re.compile("|".join(rf"\b(?P<{name}>{words})\b" for name, words in CATEGORIES.items()), re.IGNORECASE)


def main() -> None:
    tokenizer = load_tokenizer()
    rows = []
    for row in json.loads((DATA / "sharegpt_prompts.json").read_text()):
        prompt = row["conversations"][0]["value"]
        if not 256 < len(tokenizer(prompt).input_ids) <= 1024:
            continue
        found = VERB.search(prompt[:400]) or VERB.search(prompt[-300:])
        if found:
            rows.append({"id": row["id"], "category": found.lastgroup, "prompt": prompt})
    with open(DATA / "copy_heavy.jsonl", "w") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts = {name: sum(row["category"] == name for row in rows) for name in CATEGORIES}
    print(f"{len(rows)} prompts: {counts}")


if __name__ == "__main__":
    main()
