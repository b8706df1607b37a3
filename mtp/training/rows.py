"""Read training and prompt data: JSON, JSON lines, dataset folders and `datasets` ids, in four row formats."""

import gzip
import json
from pathlib import Path

import datasets

FORMATS = (
    "ShareGPT (`conversations`: [{`from`, `value`}]), chat (`messages`: [{`role`, `content`}]), "
    "Alpaca (`instruction`, optional `input`, `output`) or plain `text`"
)
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}


def read_rows(source: str, split: str = "train") -> list[dict]:
    """Rows of a JSON list or JSON-lines file (`.jsonl.gz`: gzip-compressed); of a folder: every JSON-lines file
    in it and below, in path order (such as the parts `mtp.training.distill` writes), else a `datasets` folder
    (`save_to_disk` or data files); or of a Hugging Face `datasets` id."""
    path = Path(source).expanduser()
    if path.name.endswith((".json", ".jsonl", ".jsonl.gz")):
        if not path.is_file():
            raise FileNotFoundError(f"Data file {str(path)!r} does not exist: check the path.")
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as file:
            text = file.read()
        if path.suffix == ".json" and text.lstrip().startswith("["):
            return json.loads(text)
        rows = []
        for number, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON text may hold U+2028 or \x1c
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(
                        f"{path}:{number} is not valid JSON ({error.msg}): fix or delete that line."
                    ) from None
        return rows
    if path.is_dir():
        lines = sorted(file for file in path.rglob("*") if file.name.endswith((".jsonl", ".jsonl.gz")))
        if lines:
            return [row for file in lines for row in read_rows(str(file))]
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            return list(loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded)
        return list(datasets.load_dataset(str(path), split=split))
    if not hub_id(source):
        raise FileNotFoundError(f"Data {source!r} does not exist: give a .json/.jsonl file, a folder or a datasets id.")
    return list(datasets.load_dataset(source, split=split))


def hub_id(source: str) -> bool:
    """Whether `read_rows` reads `source` from the Hugging Face hub (a `datasets` id: no local file or folder)."""
    path = Path(source).expanduser()
    local = path.name.endswith((".json", ".jsonl", ".jsonl.gz")) or path.is_dir()
    return not local and not source.startswith((".", "/", "~")) and source.count("/") <= 1


def to_example(row: dict) -> list[dict] | str | None:
    """A row as chat messages ([{role, content}]) or plain text; None if its format is not one of FORMATS."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("conversations"), list):
        turns = row["conversations"]
        if not all(isinstance(turn, dict) and turn.get("from") in _SHAREGPT_ROLES for turn in turns):
            return None
        return [{"role": _SHAREGPT_ROLES[turn["from"]], "content": str(turn.get("value", ""))} for turn in turns]
    if isinstance(row.get("messages"), list):
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in row["messages"]):
            return None
        return [{"role": m["role"], "content": str(m["content"])} for m in row["messages"]]
    if "instruction" in row and "output" in row:
        prompt = "\n\n".join(part for part in (row["instruction"], row.get("input")) if part)
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    if isinstance(row.get("text"), str):
        return row["text"]
    return None
