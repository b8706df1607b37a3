import json
import subprocess
import sys

import pytest

from mtp.tools.bench import markdown, summarise
from tests.conftest import DATA, ROOT, save_random_heads


@pytest.mark.parametrize("sampling", [["--lookup", "4", "--repeat", "2"],
                                      ["--temperature", "0.7", "--top-p", "0.9", "--seed", "0"]],
                         ids=["greedy-lookup", "sampling-heads-alone"])  # fmt: skip
def test_bench_writes_its_json_and_table_and_finds_no_mismatch(tmp_path, sampling):
    path, _, _ = save_random_heads(tmp_path, "own")
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "mtp.tools.bench", "--drafter", path, "--questions", str(DATA / "mt_bench.jsonl"),
               "--limit", "3", "--max-new-tokens", "12", "--out", str(out), *sampling]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report) == {"settings", "summary", "questions"} and len(report["questions"]) == 3
    assert list(report["summary"]) == ["writing", "roleplay", "reasoning", "overall"]  # one per category first
    overall = report["summary"]["overall"]
    greedy = "--temperature" not in sampling
    assert overall["mismatches"] == (None if not greedy else 0) and overall["questions"] == 3
    questions = report["questions"]
    assert overall["tokens"] == sum(q["mtp_tokens"] for q in questions) > 0
    assert overall["tau"] == pytest.approx(overall["tokens"] / sum(q["forward_passes"] for q in questions))
    for q in questions:  # an accept length per verification pass; they settle every token but the prefill's one
        assert q["forward_passes"] == len(q["accept_lengths"]) and 1 + sum(q["accept_lengths"]) >= q["mtp_tokens"]
    assert {"speedup_vs_plain", "speedup_vs_lookup", "mtp_tokens_per_second"} <= set(overall)
    assert ("speedup_vs_heads" in overall) is greedy  # mtp with its heads alone, when its lookup is on
    # plain generate with mtp's products too, only where they are not the usual ones for one row
    assert ("speedup_vs_plain_fast" in overall) is report["settings"]["plain_fast"]
    assert overall["accepted_from_heads"] + overall["accepted_from_lookup"] == sum(
        sum(q["accept_lengths"]) - q["forward_passes"] for q in questions
    )
    assert overall["accepted_from_lookup"] == sum(q["lookup_accepted"] for q in questions)
    assert not greedy or all(row["heads_tokens"] == row["mtp_tokens"] for row in questions)  # as many tokens
    # greedy: every output equals plain generate's; sampling: outputs differ by chance, nothing is compared
    assert all(row["matches_plain"] is (True if greedy else None) for row in report["questions"])
    assert report["settings"]["temperature"] == (0.0 if greedy else 0.7)
    assert report["settings"]["repeat"] == (2 if greedy else 1)  # greedy: each decoder timed twice, its best kept
    assert out.with_suffix(".md").read_text().startswith("| category |") and "| overall | 3 |" in done.stdout


def test_bench_of_batches_measures_each_size_and_finds_mtp_equal_to_each_prompt_alone(tmp_path):
    path, _, _ = save_random_heads(tmp_path, "own")
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "mtp.tools.bench", "--drafter", path, "--questions", str(DATA / "mt_bench.jsonl"),
               "--limit", "5", "--max-new-tokens", "12", "--out", str(out), "--batch-size", "1", "2", "4"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["batches"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert r["mismatches_vs_alone"] == 0 and r["mtp_tokens_per_second"] > 0 and r["tau"] >= 1
        assert r["speedup_vs_plain"] == pytest.approx(r["mtp_tokens_per_second"] / r["plain_tokens_per_second"])
    assert rows[0]["speedup_vs_mtp_alone"] == 1 and rows[0]["plain_batched_mismatches_vs_alone"] == 0  # B = 1
    assert out.with_suffix(".md").read_text().startswith("| B |") and "| 4 |" in done.stdout


def row(passes, tokens, plain, lookup, seconds, accepted, from_lookup, matches=True):
    """A benchmark row: mtp's forward passes, tokens of mtp, plain and lookup, seconds of mtp, plain and lookup,
    mtp's accept lengths and its accepted candidates from lookup."""
    return {"forward_passes": passes, "mtp_tokens": tokens, "plain_tokens": plain, "lookup_tokens": lookup,
            "mtp_seconds": seconds[0], "plain_seconds": seconds[1], "lookup_seconds": seconds[2],
            "accept_lengths": accepted, "lookup_accepted": from_lookup, "matches_plain": matches}  # fmt: skip


ROWS = [row(4, 10, 10, 10, (0.5, 1.0, 0.5), [3, 3, 2, 1], 2),
        row(6, 20, 14, 20, (1.0, 1.0, 2.5), [4] + [3] * 5, 5, False),
        row(5, 5, 6, 5, (0.25, 0.5, 0.5), [1] * 5, 0)]  # fmt: skip


def test_summarise_counts_each_methods_own_tokens_and_only_real_mismatches():
    summary = summarise(ROWS)
    # mtp: 35 tokens in 1.75 s over 15 passes; plain: 30 tokens in 2.5 s; lookup: 35 tokens in 3.5 s
    assert summary == pytest.approx({
        "questions": 3, "tokens": 35, "tau": 35 / 15, "mtp_tokens_per_second": 20.0,
        "plain_tokens_per_second": 12.0, "lookup_tokens_per_second": 10.0, "speedup_vs_plain": 20 / 12,
        "speedup_vs_lookup": 2.0, "speedup_vs_fastest_plain": 20 / 12, "accepted_from_heads": 11,
        "accepted_from_lookup": 7, "mismatches": 1,
    })  # fmt: skip  # candidates: 5 + 13 + 0 accepted, bonus tokens left out; 2 + 5 of them from lookup
    with_heads = summarise(
        [{**r, "heads_tokens": r["mtp_tokens"], "heads_seconds": 2 * r["mtp_seconds"]} for r in ROWS]
    )
    assert with_heads["heads_tokens_per_second"] == 10.0 and with_heads["speedup_vs_heads"] == 2.0
    assert summarise([{**r, "matches_plain": None} for r in ROWS])["mismatches"] is None  # sampling: not compared
    fast = summarise([{**r, "plain_fast_tokens": r["plain_tokens"], "plain_fast_seconds": r["plain_seconds"] / 2}
                      for r in ROWS])  # fmt: skip
    assert fast["plain_fast_tokens_per_second"] == 24.0 and fast["speedup_vs_fastest_plain"] == pytest.approx(20 / 24)
    slow = summarise([{**r, "plain_fast_tokens": r["plain_tokens"], "plain_fast_seconds": r["plain_seconds"] * 2}
                      for r in ROWS])  # fmt: skip
    assert slow["speedup_vs_fastest_plain"] == pytest.approx(20 / 12)  # the faster of the two, whichever it is


def test_markdown_prints_one_row_per_category_with_the_summary_figures():
    table = markdown({"a": summarise(ROWS[:1]), "overall": summarise(ROWS)}).splitlines()
    assert table[0].startswith("| category | questions | tau | mtp tok/s | plain tok/s | lookup tok/s | vs plain |")
    assert table[2] == "| a | 1 | 2.50 | 20.0 | 10.0 | 20.0 | 2.00x | 1.00x | 3 / 2 | 0 |"
    assert table[3] == "| overall | 3 | 2.33 | 20.0 | 12.0 | 10.0 | 1.67x | 2.00x | 11 / 7 | 1 |"
    sampled = markdown({"overall": summarise([{**r, "matches_plain": None} for r in ROWS])})
    assert sampled.splitlines()[-1].endswith("| 2.00x | 11 / 7 | n/a (sampling) |")
    heads = [{**r, "heads_tokens": r["mtp_tokens"], "heads_seconds": 2 * r["mtp_seconds"]} for r in ROWS]
    table = markdown({"overall": summarise(heads)}).splitlines()
    assert "| lookup tok/s | heads tok/s | vs plain | vs lookup | vs heads |" in table[0]
    assert table[2] == "| overall | 3 | 2.33 | 20.0 | 12.0 | 10.0 | 10.0 | 1.67x | 2.00x | 2.00x | 11 / 7 | 1 |"
    fast = [{**r, "plain_fast_tokens": r["plain_tokens"], "plain_fast_seconds": r["plain_seconds"] / 2} for r in ROWS]
    table = markdown({"overall": summarise(fast)}).splitlines()
    assert "| plain tok/s | plain fast tok/s | lookup tok/s | vs fastest plain | vs plain | vs plain fast |" in table[0]
    assert table[2] == "| overall | 3 | 2.33 | 20.0 | 12.0 | 24.0 | 10.0 | 0.83x | 1.67x | 0.83x | 2.00x | 11 / 7 | 1 |"


def test_other_drafters_are_summarised_beside_mtp_each_with_its_own_tau_and_mismatches():
    rows = [{**r, "against_1_tokens": r["mtp_tokens"], "against_1_seconds": 4 * r["mtp_seconds"],
             "against_1_passes": 35, "against_1_matches_plain": i != 0,
             "against_2_tokens": r["mtp_tokens"], "against_2_seconds": r["mtp_seconds"] / 2,
             "against_2_passes": 15, "against_2_matches_plain": True}
            for i, r in enumerate(ROWS)]  # fmt: skip
    summary = summarise(rows)
    assert summary["against_1_tokens_per_second"] == 5.0 and summary["speedup_vs_against_1"] == 4.0
    assert summary["against_1_tau"] == pytest.approx(35 / 105) and summary["against_1_mismatches"] == 1
    assert summary["speedup_vs_against_2"] == 0.5
    assert summary["against_2_tau"] == pytest.approx(35 / 45) and summary["against_2_mismatches"] == 0
    table = markdown({"overall": summary}).splitlines()
    assert "| against 1 tok/s | against 2 tok/s | vs plain | vs lookup | vs against 1 | vs against 2 |" in table[0]
    assert table[0].endswith("| against 1 tau | against 1 mismatches | against 2 tau | against 2 mismatches |")
    assert table[2].endswith("| 4.00x | 0.50x | 11 / 7 | 1 | 0.33 | 1 | 0.78 | 0 |")
