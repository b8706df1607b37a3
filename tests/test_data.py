import json

import datasets
import pytest
import torch

from mtp.base import load_tokenizer
from mtp.training.data import DrafterDataModule, bucket, collate, encode
from mtp.training.distill import Distill
from mtp.training.rows import read_rows, to_example
from tests.conftest import TINY_BASE, TINY_CHAT

CHAT = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sky."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_four_row_formats_become_the_same_chat():
    sharegpt = {
        "conversations": [{"from": "human", "value": CHAT[0]["content"]}, {"from": "gpt", "value": CHAT[1]["content"]}]
    }
    alpaca = {"instruction": "Name a colour.", "input": "", "output": "Blue, like the sky."}
    assert to_example(sharegpt) == to_example({"messages": CHAT}) == to_example(alpaca) == CHAT
    assert to_example({"instruction": "Name a colour.", "input": "Warm.", "output": "Red."})[0]["content"] == (
        "Name a colour.\n\nWarm."
    )
    assert to_example({"text": "plain"}) == "plain"
    assert to_example({"question": "?"}) is None and to_example({"messages": [{"from": "x"}]}) is None


def test_loss_mask_covers_exactly_the_assistant_answers(tokenizer):
    chat = CHAT + [{"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]
    ids, mask = encode(tokenizer, chat, max_length=512)
    assert ids.shape == mask.shape
    learned = tokenizer.decode(ids[mask])
    assert learned == "Blue, like the sky.<|im_end|>\nGreen.<|im_end|>\n"
    assert "Name a colour" in tokenizer.decode(ids[~mask]) and "assistant" in tokenizer.decode(ids[~mask])


def test_plain_text_is_learned_everywhere_and_truncation_applies(tokenizer):
    ids, mask = encode(tokenizer, "one two three four five six seven", max_length=4)
    assert len(ids) == 4 and mask.all()
    assert encode(tokenizer, CHAT, max_length=5) == "no assistant token within max_length"
    assert encode(tokenizer, CHAT[:1], max_length=512) == "no assistant turn"


def test_collate_pads_right_and_masks_padding():
    batch = collate(
        [(torch.tensor([5, 6, 7]), torch.tensor([False, True, True])), (torch.tensor([8]), torch.tensor([True]))]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]


def test_bucketing_covers_every_example_once_and_cuts_padding():
    lengths = [int(x) for x in torch.randint(5, 500, (1000,), generator=torch.Generator().manual_seed(0))]
    batches = bucket(lengths, batch_size=8)
    assert sorted(i for batch in batches for i in batch) == list(range(1000))

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    unsorted = [list(range(i, min(i + 8, 1000))) for i in range(0, 1000, 8)]
    assert padding(batches) < 0.1 * padding(unsorted)


def test_datamodule_skips_and_counts_rows_without_an_answer(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Name colour {i}."}, CHAT[1]]} for i in range(6)]
    rows += [{"messages": CHAT[:1]}, {"question": "not a known format"}]
    data = DrafterDataModule(write_jsonl(tmp_path / "chat.jsonl", rows), TINY_BASE, batch_size=2, val_fraction=0.2)
    with pytest.warns(UserWarning, match=r"Skipped 2 of 8 rows.*'no assistant turn': 1.*not ShareGPT.*: 1"):
        data.setup("fit")
    assert len(data.train_examples) + len(data.val_examples) == 6 and len(data.val_examples) == 1
    batches = list(data.train_dataloader())  # 5 examples in batches of 2, 2 and 1, in the seed's order
    assert sorted(len(batch["input_ids"]) for batch in batches) == [1, 2, 2]
    assert all(batch["loss_mask"].any() for batch in batches)


def test_every_answer_to_a_held_out_prompt_is_held_out(tmp_path):
    """Two answers to one prompt (a greedy and a sampled one) land on the same side of the split: validation
    measures prompts the heads never saw, not a second answer to a training prompt."""
    rows = [
        {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": answer}]}
        for i in range(20)
        for answer in (f"Answer {i}.", f"Another answer {i}.")
    ]
    data = DrafterDataModule(write_jsonl(tmp_path / "two.jsonl", rows), TINY_BASE, val_fraction=0.25)
    data.setup("fit")
    tokenizer = load_tokenizer(TINY_BASE)

    def questions(examples):  # the question each example answers, read back from its tokens
        texts = [tokenizer.decode(ids) for ids, _ in examples]
        return [next(f"Question {i}?" for i in range(20) if f"Question {i}?" in text) for text in texts]

    val, train = questions(data.val_examples), questions(data.train_examples)
    assert len(val) == 10 and len(train) == 30 and not set(val) & set(train)
    assert all(val.count(question) == 2 for question in val)  # both answers of each held-out prompt


def test_val_data_validates_on_its_answers_to_prompts_never_trained_on(tmp_path):
    """With val_data (the greedy answers, say), validation reads its answers to the held-out prompts and to prompts
    `data` lacks, never its answers to a trained prompt."""

    def chats(answers, questions):
        return [
            {
                "messages": [
                    {"role": "user", "content": f"Question {i}?"},
                    {"role": "assistant", "content": a + f" {i}."},
                ]
            }
            for i in questions
            for a in answers
        ]

    train_file = write_jsonl(tmp_path / "both.jsonl", chats(("Greedy", "Sampled"), range(20)))
    val_file = write_jsonl(tmp_path / "greedy.jsonl", chats(("Greedy",), [*range(20), 99]))
    data = DrafterDataModule(train_file, TINY_BASE, val_fraction=0.25, val_data=val_file)
    data.setup("fit")
    tokenizer = load_tokenizer(TINY_BASE)
    val = [tokenizer.decode(ids) for ids, _ in data.val_examples]
    train = [tokenizer.decode(ids) for ids, _ in data.train_examples]
    held_out = {i for i in range(20) if not any(f"Question {i}?" in text for text in train)}
    assert len(train) == 30 and len(held_out) == 5
    assert sorted(val) == sorted(
        next(t for t in val if f"Question {i}?" in t and f"Greedy {i}." in t) for i in [*held_out, 99]
    )


def test_all_rows_bad_is_an_error(tmp_path):
    data = DrafterDataModule(write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHAT[:1]}] * 3), TINY_BASE)
    with pytest.raises(ValueError, match=r"No usable row.*3 rows.*no assistant turn"):
        data.setup("fit")


def test_missing_and_malformed_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(str(tmp_path / "missing.jsonl"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"messages": CHAT}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:2 is not valid JSON"):
        read_rows(str(broken))


def test_sharegpt_json_alpaca_json_and_a_dataset_folder_load(tmp_path, tokenizer):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(
        json.dumps(
            [{"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]
        )
    )
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Hi", "input": "", "output": "Hello"}]))
    datasets.Dataset.from_list([{"messages": CHAT}]).save_to_disk(str(tmp_path / "saved"))
    assert to_example(read_rows(str(sharegpt))[0]) == to_example(read_rows(str(alpaca))[0])
    assert to_example(read_rows(str(tmp_path / "saved"))[0]) == CHAT
    assert read_rows(TINY_CHAT) and all(to_example(row) for row in read_rows(TINY_CHAT))


def test_validation_batches_are_the_held_out_examples(tmp_path, tokenizer):
    """The validation loader yields the held-out examples, each once, and no training one; the training loader
    every other example once a pass."""
    rows = [{"text": f"row {i} " + "word " * (i % 7)} for i in range(20)]  # 20 different texts
    data = DrafterDataModule(write_jsonl(tmp_path / "text.jsonl", rows), TINY_BASE, batch_size=3, val_fraction=0.25)
    data.setup("fit")

    def seen(loader) -> list[tuple[int, ...]]:  # the token ids of each example, over one pass of a loader
        return [
            tuple(ids[attended.bool()].tolist())
            for batch in loader
            for ids, attended in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]

    train, val = seen(data.train_dataloader()), seen(data.val_dataloader())
    assert len(set(train)) == len(train) == 15 and len(set(val)) == len(val) == 5 and not set(train) & set(val)
    assert sorted(train + val) == sorted(tuple(tokenizer(row["text"]).input_ids) for row in rows)
    assert sorted(val) == sorted(tuple(ids.tolist()) for ids, _ in data.val_examples)
    assert sorted(seen(data.train_dataloader())) == sorted(train)  # the same examples again


def test_a_json_lines_value_with_unicode_line_separators_is_one_row(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028 and \\x1c unescaped (distilled answers hold them); only \\n
    ends a JSON line."""
    path = tmp_path / "rows.jsonl"
    rows = [{"text": "one\u2028two\x1cthree"}, {"text": "four"}]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    assert read_rows(str(path)) == rows


def test_datasets_ids_are_downloaded_in_prepare_data_and_nothing_else(tmp_path, monkeypatch):
    """Lightning runs `prepare_data` on one process of each node before any `setup`: there the hub ids (prompts to
    distill, data, validation data) are fetched; local files and the answers' folder are left to `setup`."""
    fetched = []
    monkeypatch.setattr(datasets, "load_dataset", lambda source, split: fetched.append((source, split)) or [])
    DrafterDataModule("org/chats", TINY_BASE, val_data="org/greedy", split="test").prepare_data()
    monkeypatch.chdir(tmp_path)  # "runs/answers", not written yet, reads as an id but is where answers go
    DrafterDataModule("runs/answers", TINY_BASE, distill=Distill(prompts="org/prompts")).prepare_data()
    DrafterDataModule(TINY_CHAT, TINY_BASE, val_data=TINY_CHAT).prepare_data()
    assert fetched == [("org/chats", "test"), ("org/greedy", "test"), ("org/prompts", "train")]
