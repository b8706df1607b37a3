import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtp.training.distill
from mtp.base import load_base
from mtp.training.distill import Distill, read_done, run_distill
from mtp.training.rows import read_rows
from tests.conftest import ROOT, TINY_BASE, save_random_heads


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.json"
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"Question number {i}?"}]} for i in range(6)]
    rows.insert(2, {"conversations": [{"from": "human", "value": "word " * 100}]})  # too long: skipped
    path.write_text(json.dumps(rows))
    return str(path)


def lines(folder):
    return read_rows(str(folder))


def test_distillation_answers_prompts_and_resumes_without_losing_rows(prompts, tmp_path):
    out = tmp_path / "answers"
    settings = dict(prompts=prompts, max_new_tokens=5, max_prompt_tokens=60, batch_size=2)
    run_distill(Distill(limit=3, **settings), TINY_BASE, out)
    first = lines(out)
    assert sorted(row["index"] for row in first) == [0, 1, 3]  # row 2 is too long
    assert all(row["messages"][0]["content"].startswith("Question") for row in first)
    assert all(row["messages"][1]["role"] == "assistant" for row in first)

    run_distill(Distill(limit=5, **settings), TINY_BASE, out)  # a rerun with more prompts only adds the new ones
    second = lines(out)
    assert second[:3] == first and sorted(row["index"] for row in second) == [0, 1, 3, 4, 5]

    mtime = (out / "rank-00000" / "part-00000.jsonl").stat().st_mtime_ns
    run_distill(Distill(limit=5, **settings), TINY_BASE, out)  # nothing left to do: untouched
    assert (out / "rank-00000" / "part-00000.jsonl").stat().st_mtime_ns == mtime


def test_a_torn_last_line_is_cut_off_and_answered_again(prompts, tmp_path):
    out = tmp_path / "answers"
    settings = dict(prompts=prompts, max_new_tokens=5, max_prompt_tokens=60, batch_size=2, limit=2)
    run_distill(Distill(**settings), TINY_BASE, out)
    part = out / "rank-00000" / "part-00000.jsonl"
    complete = part.read_text()
    part.write_text(complete.splitlines(keepends=True)[0] + complete.splitlines()[1][:20])  # crash mid-write
    assert read_done(out, part.parent, 1) == {json.loads(complete.splitlines()[0])["index"]}
    run_distill(Distill(**settings), TINY_BASE, out)
    assert sorted(row["index"] for row in lines(out)) == [0, 1]


def test_a_torn_line_in_the_shard_of_a_rank_that_no_longer_runs_is_cut_off_and_answered_again(prompts, tmp_path):
    """Two processes answered, the second crashed mid-write; a rerun on one process answers the torn prompt again
    and training then reads every shard, each prompt once (without the cut: "not valid JSON")."""
    out = tmp_path / "answers"
    settings = dict(prompts=prompts, max_new_tokens=5, max_prompt_tokens=60, batch_size=2, limit=4)
    for rank in range(2):
        run_distill(Distill(**settings), TINY_BASE, out, rank=rank, world_size=2)
    part = out / "rank-00001" / "part-00000.jsonl"
    complete = part.read_text().splitlines(keepends=True)
    part.write_text(complete[0] + complete[1][:20])  # the second process's crash mid-write
    assert json.loads(complete[1])["index"] not in read_done(out, out / "rank-00000", 2)
    assert part.read_text() == complete[0] + complete[1][:20]  # rank 1 still runs: its part is not cut
    run_distill(Distill(**settings), TINY_BASE, out)
    assert sorted(row["index"] for row in lines(out)) == [0, 1, 3, 4]


def test_full_parts_are_compressed_and_a_resumed_run_reads_and_extends_them(prompts, tmp_path):
    out = tmp_path / "answers-t0.8"  # a folder name with a dot is still a folder
    settings = dict(prompts=prompts, max_new_tokens=3, max_prompt_tokens=60, batch_size=2, part_size=2)
    run_distill(Distill(limit=3, **settings), TINY_BASE, out)
    shard = out / "rank-00000"
    assert sorted(path.name for path in shard.iterdir()) == ["part-00000.jsonl.gz", "part-00001.jsonl"]
    with gzip.open(shard / "part-00000.jsonl.gz", "rt") as packed:
        assert len(packed.read().splitlines()) == 2
    (shard / "part-00000.jsonl").write_text("stale copy left by a crash while compressing\n")
    run_distill(Distill(limit=6, **settings), TINY_BASE, out)
    names = ["part-00000.jsonl.gz", "part-00001.jsonl.gz", "part-00002.jsonl.gz"]
    assert sorted(path.name for path in shard.iterdir()) == names  # 6 answers: three full parts, no stale copy
    assert sorted(row["index"] for row in lines(out)) == [0, 1, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="go to a folder of parts, not to the file"):
        run_distill(Distill(**settings), TINY_BASE, tmp_path / "answers.jsonl")


VICUNA = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
VICUNA += "{% if add_generation_prompt %}ASSISTANT:{% endif %}"


def varied_tiny_base(folder) -> str:
    """The tiny Llama with untied, larger random weights, so that its greedy answers vary from token to token
    (the tied tiny model only repeats its last token, a newline: every answer would strip to ""), and a
    Vicuna-style chat template, whose generation prompt ends in a visible token (ChatML's ends in a newline,
    which an answer sliced one token early would hide behind `strip`)."""
    folder.mkdir()
    for file in Path(TINY_BASE).parent.iterdir():  # the tokenizer
        shutil.copy(file, folder)
    (folder / "chat_template.jinja").write_text(VICUNA)
    config = json.loads(Path(TINY_BASE).read_text()) | {"tie_word_embeddings": False, "initializer_range": 0.2}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder / "config.json")


def test_answers_batched_equal_plain_greedy_generate_of_each_prompt(tmp_path):
    """Prompts of different lengths answered in one batch: each answer is that of a greedy `generate` of the
    prompt alone (pins the chat template and the slicing off of the prompt)."""
    base = varied_tiny_base(tmp_path / "model")
    questions = ["Hi?", "Count from one to nine, please.", "Why is the sky blue on a clear day, and why not red?"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"conversations": [{"from": "human", "value": q}]} for q in questions]))
    out = tmp_path / "answers"
    run_distill(Distill(prompts=str(prompts), max_new_tokens=10, batch_size=3), base, out)
    answers = {row["index"]: row["messages"][1]["content"] for row in lines(out)}

    model, tokenizer = load_base(base)
    lengths = set()
    for index, question in enumerate(questions):
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        lengths.add(inputs["input_ids"].shape[1])
        output = model.generate(
            **inputs, max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        top2 = torch.cat(output.scores).topk(2).values  # (new tokens, 2)
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # no near tie that batched arithmetic could flip
        new_tokens = output.sequences[0, inputs["input_ids"].shape[1] :]  # (new tokens,)
        assert len(set(new_tokens.tolist())) > 3  # a varied answer, which a misplaced token would change
        assert answers[index] == tokenizer.decode(new_tokens, skip_special_tokens=True).strip(), index
    assert len(lengths) == len(questions)  # prompts of different lengths side by side in the batch


@pytest.mark.parametrize(
    "bad, message", [(dict(max_new_tokens=0), "max_new_tokens=0"), (dict(temperature=-1), "temperature=-1")]
)
def test_bad_distill_settings_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        Distill(prompts="p.json", **bad)


def test_a_finished_row_takes_the_next_prompt_and_every_answer_is_still_the_prompts_own(tmp_path):
    """Continuous batching: 5 prompts, 2 rows, an EOS that ends one answer after 3 tokens while the others run
    on, so rows are refilled at different steps, next to rows of other ages. Each answer must be a greedy
    `generate` of its prompt alone."""
    base = varied_tiny_base(tmp_path / "model")
    questions = ["Hi?", "Count from one to nine.", "Why is the sky blue?", "Name a fruit.", "What is two and two?"]
    model, tokenizer = load_base(base)
    inputs = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        for q in questions
    ]
    model.generation_config.eos_token_id = None
    free = [model.generate(**x, max_new_tokens=12, do_sample=False)[0, x["input_ids"].shape[1] :] for x in inputs]
    eos = int(free[0][3])  # answer 0 ends after 3 tokens
    assert eos not in free[0][:3].tolist()
    config = json.loads(Path(base).read_text()) | {"eos_token_id": eos}
    Path(base).write_text(json.dumps(config))
    model.generation_config.eos_token_id = eos
    expected = []
    for x in inputs:
        answer = model.generate(**x, max_new_tokens=12, do_sample=False)[0, x["input_ids"].shape[1] :].tolist()
        expected.append(tokenizer.decode(answer[: answer.index(eos)] if eos in answer else answer).strip())
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"conversations": [{"from": "human", "value": q}]} for q in questions]))
    out = tmp_path / "answers"
    run_distill(Distill(prompts=str(prompts), max_new_tokens=12, batch_size=2), base, out)
    answers = {row["index"]: row["messages"][1]["content"] for row in lines(out)}
    assert [answers[i] for i in range(5)] == expected
    assert len({len(tokenizer.encode(text)) for text in expected}) > 1  # answers of different lengths


def test_a_drafter_answers_as_the_base_alone_and_samples_do_not_depend_on_the_batch(tmp_path):
    """One engine: distillation decodes with the project's decoder, so a drafter (here random heads with prompt
    lookup) speeds it and changes no greedy answer; a sampled answer is its prompt's own (seeded by its index),
    whatever the batch it was answered in."""
    base = varied_tiny_base(tmp_path / "model")
    heads, _, _ = save_random_heads(tmp_path / "heads")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": f"Question {i}: " + "why? " * i} for i in range(5)]))
    found = {}
    for name, settings in {
        "alone": {},
        "drafter": {"drafter": heads},
        "sampled 1": {"temperature": 1.0},
        "sampled 3": {"temperature": 1.0, "batch_size": 3},
    }.items():
        run_distill(
            Distill(prompts=str(prompts), max_new_tokens=8, **({"batch_size": 2} | settings)), base, tmp_path / name
        )
        found[name] = by_index(lines(tmp_path / name))
    assert found["drafter"] == found["alone"] and len(found["alone"]) == 5
    assert found["sampled 1"] == found["sampled 3"] != found["alone"]


def by_index(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda row: row["index"])


def test_two_ranks_answer_what_one_process_answers_each_its_share_in_its_own_shard(tmp_path):
    base = varied_tiny_base(tmp_path / "model")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": f"Question {i}: " + "why? " * i} for i in range(7)]))
    distill = Distill(prompts=str(prompts), max_new_tokens=6, batch_size=2)
    run_distill(distill, base, tmp_path / "alone")
    for rank in (1, 0):
        run_distill(distill, base, tmp_path / "split", rank=rank, world_size=2)
    shares = [[row["index"] for row in lines(tmp_path / "split" / f"rank-{rank:05d}")] for rank in (0, 1)]
    assert sorted(map(len, shares)) == [3, 4] and not set(shares[0]) & set(shares[1])  # every other prompt
    assert by_index(lines(tmp_path / "split")) == by_index(lines(tmp_path / "alone"))


def test_a_run_killed_mid_way_and_rerun_with_another_number_of_processes_loses_and_duplicates_nothing(
    tmp_path, monkeypatch
):
    base = varied_tiny_base(tmp_path / "model")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": f"Question {i}: " + "why? " * i} for i in range(9)]))
    distill = Distill(prompts=str(prompts), max_new_tokens=6, batch_size=2)
    run_distill(distill, base, tmp_path / "alone")
    answering = mtp.training.distill.answer_all

    def killed_after_two(*args):  # the process dies after its second answer is written
        for count, answer in enumerate(answering(*args)):
            if count == 2:
                raise KeyboardInterrupt
            yield answer

    monkeypatch.setattr(mtp.training.distill, "answer_all", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_distill(distill, base, tmp_path / "split", rank=0, world_size=3)
    monkeypatch.setattr(mtp.training.distill, "answer_all", answering)
    run_distill(distill, base, tmp_path / "split", rank=2, world_size=3)  # rank 1 never ran
    assert len(lines(tmp_path / "split")) == 2 + 3
    for rank in (0, 1):  # rerun on 2 processes: they share out what is left
        run_distill(distill, base, tmp_path / "split", rank=rank, world_size=2)
    assert by_index(lines(tmp_path / "split")) == by_index(lines(tmp_path / "alone"))  # each prompt once


@pytest.mark.slow
def test_training_under_ddp_on_two_processes_distills_on_both_first(tmp_path):
    """train.py with 2 CPU processes (gloo): each process answers its share into its own shard, both wait for
    the other, then train on all of them; the answers are one process's, order aside."""
    base = varied_tiny_base(tmp_path / "model")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps([{"conversations": [{"from": "human", "value": f"Question {i}?"}]} for i in range(8)])
    )
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--model.base_model",
        base,
        "--data.data",
        str(tmp_path / "answers"),
        "--data.distill.prompts",
        str(prompts),
        "--data.distill.max_new_tokens",
        "6",
        "--data.distill.batch_size",
        "2",
        "--data.batch_size",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.max_steps",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(path.name for path in (tmp_path / "answers").iterdir()) == ["rank-00000", "rank-00001"]
    run_distill(Distill(prompts=str(prompts), max_new_tokens=6, batch_size=2), base, tmp_path / "alone")
    assert by_index(lines(tmp_path / "answers")) == by_index(lines(tmp_path / "alone"))
