import json

import pytest

from mtp.distill import Distill, read_done, run_distill
from tests.conftest import TINY_BASE


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.json"
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"Question number {i}?"}]} for i in range(6)]
    rows.insert(2, {"conversations": [{"from": "human", "value": "word " * 100}]})  # too long: skipped
    path.write_text(json.dumps(rows))
    return str(path)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_distillation_answers_prompts_and_resumes_without_losing_rows(prompts, tmp_path):
    out = tmp_path / "answers.jsonl"
    settings = dict(prompts=prompts, max_new_tokens=5, max_prompt_tokens=60, batch_size=2)
    run_distill(Distill(limit=3, **settings), TINY_BASE, out)
    first = lines(out)
    assert sorted(row["index"] for row in first) == [0, 1, 3]  # row 2 is too long
    assert all(row["messages"][0]["content"].startswith("Question") for row in first)
    assert all(row["messages"][1]["role"] == "assistant" for row in first)

    run_distill(Distill(limit=5, **settings), TINY_BASE, out)  # a rerun with more prompts only adds the new ones
    second = lines(out)
    assert second[:3] == first and sorted(row["index"] for row in second) == [0, 1, 3, 4, 5]

    mtime = out.stat().st_mtime_ns
    run_distill(Distill(limit=5, **settings), TINY_BASE, out)  # nothing left to do: untouched
    assert out.stat().st_mtime_ns == mtime


def test_a_torn_last_line_is_cut_off_and_answered_again(prompts, tmp_path):
    out = tmp_path / "answers.jsonl"
    settings = dict(prompts=prompts, max_new_tokens=5, max_prompt_tokens=60, batch_size=2, limit=2)
    run_distill(Distill(**settings), TINY_BASE, out)
    complete = out.read_text()
    out.write_text(complete.splitlines(keepends=True)[0] + complete.splitlines()[1][:20])  # crash mid-write
    assert read_done(out) == {json.loads(complete.splitlines()[0])["index"]}
    run_distill(Distill(**settings), TINY_BASE, out)
    assert sorted(row["index"] for row in lines(out)) == [0, 1]


@pytest.mark.parametrize(
    "bad, message", [(dict(max_new_tokens=0), "max_new_tokens=0"), (dict(temperature=-1), "temperature=-1")]
)
def test_bad_distill_settings_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        Distill(prompts="p.json", **bad)
