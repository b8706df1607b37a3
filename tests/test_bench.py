import json
import subprocess
import sys
from dataclasses import replace

import pytest

from mtp.decoding.acceptance import Acceptance
from mtp.tools.bench import Answered, Run, acceptance_line, markdown, summarise
from tests.conftest import DATA, ROOT, save_random_heads


@pytest.mark.parametrize(
    "sampling",
    [["--lookup", "4", "--repeat", "2"], ["--temperature", "0.7", "--top-p", "0.9", "--seed", "0"]],
    ids=["greedy-lookup", "sampling-heads-alone"],
)
@pytest.mark.slow
def test_bench_writes_its_json_and_table_and_finds_no_mismatch(tmp_path, sampling):
    path, _, _ = save_random_heads(tmp_path, "own")
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        "-m",
        "mtp.tools.bench",
        "--drafter",
        path,
        "--questions",
        str(DATA / "mt_bench.jsonl"),
        "--limit",
        "3",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
        *sampling,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report) == {"settings", "summary", "questions"} and len(report["questions"]) == 3
    assert list(report["summary"]) == ["writing", "roleplay", "reasoning", "overall"]  # one per category first
    overall = report["summary"]["overall"]
    greedy = "--temperature" not in sampling
    assert overall["mismatches"] == {"mtp": None if not greedy else 0} and overall["questions"] == 3
    questions = report["questions"]
    ours = [q["runs"]["mtp"] for q in questions]
    assert overall["tau"]["mtp"] == pytest.approx(sum(r["tokens"] for r in ours) / sum(r["passes"] for r in ours))
    for q in questions:  # an accept length per verification pass; they settle every token but the prefill's one
        lengths = q["acceptance"]["lengths"]
        assert q["runs"]["mtp"]["passes"] == len(lengths) and 1 + sum(lengths) >= q["runs"]["mtp"]["tokens"]
    assert {"plain", "lookup"} <= set(overall["speedup"]) and overall["tokens_per_second"]["mtp"] > 0
    assert ("heads" in overall["speedup"]) is greedy  # mtp with its heads alone, when its lookup is on
    # plain generate with mtp's products too, only where they are not the usual ones for one row
    assert ("plain_fast" in overall["speedup"]) is report["settings"]["plain_fast"]
    accepted = [sum(q["acceptance"]["lengths"]) - len(q["acceptance"]["lengths"]) for q in questions]
    assert overall["acceptance"]["accepted"] == sum(accepted) == sum(overall["acceptance"]["by_source"].values())
    assert overall["acceptance"]["passes"] == sum(r["passes"] for r in ours)
    assert not greedy or all(q["runs"]["heads"]["tokens"] == q["runs"]["mtp"]["tokens"] for q in questions)
    # greedy: every output equals plain generate's; sampling: outputs differ by chance, nothing is compared
    assert all(r["matches_plain"] is (True if greedy else None) for r in ours)
    assert report["settings"]["temperature"] == (0.0 if greedy else 0.7)
    assert report["settings"]["repeat"] == (2 if greedy else 1)  # greedy: each decoder timed twice, its best kept
    assert out.with_suffix(".md").read_text().startswith("| category |") and "| overall | 3 |" in done.stdout


@pytest.mark.slow
def test_bench_of_batches_measures_each_size_and_finds_mtp_equal_to_each_prompt_alone(tmp_path):
    path, _, _ = save_random_heads(tmp_path, "own")
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        "-m",
        "mtp.tools.bench",
        "--drafter",
        path,
        "--questions",
        str(DATA / "mt_bench.jsonl"),
        "--limit",
        "5",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
        "--batch-size",
        "1",
        "2",
        "4",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["batches"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    for r in rows:
        speed = r["tokens_per_second"]
        assert r["mismatches_vs_alone"] == 0 and speed["mtp"] > 0 and r["tau"] >= 1
        assert r["speedup_vs_plain"] == pytest.approx(speed["mtp"] / speed["plain"])
    assert rows[0]["speedup_vs_mtp_alone"] == 1 and rows[0]["plain_batched_mismatches_vs_alone"] == 0  # B = 1
    assert out.with_suffix(".md").read_text().startswith("| B |") and "| 4 |" in done.stdout


def answered(passes, tokens, plain, lookup, seconds, lengths, from_lookup, matches=True) -> Answered:
    """A question's answers: mtp's forward passes, tokens of mtp, plain and lookup, seconds of mtp, plain and lookup,
    mtp's accept lengths and its accepted candidates from lookup."""
    runs = {
        "plain": Run(plain, seconds[1]),
        "lookup": Run(lookup, seconds[2]),
        "mtp": Run(tokens, seconds[0], passes, matches),
    }
    from_heads = sum(lengths) - len(lengths) - from_lookup
    return Answered("all", runs, Acceptance(lengths, {"heads": from_heads, "lookup": from_lookup}))


def joined(answers: list[Answered], name: str, run) -> list[Answered]:
    """`answers` with one more decoder's run, `run(i, answer)`, placed as the decoders run (before mtp, or after)."""
    placed = []
    for i, a in enumerate(answers):
        runs = {**a.runs, name: run(i, a)}
        if not name.startswith("against_"):
            runs = {
                n: runs[n]
                for n in ("plain", "plain_fast", "plain_compiled", "lookup", "heads", "mtp", *a.runs)
                if n in runs
            }
        placed.append(Answered(a.category, runs, a.acceptance))
    return placed


def unchecked(answers: list[Answered]) -> list[Answered]:
    """As sampled: nothing compared with plain `generate`."""
    return joined(answers, "mtp", lambda i, a: replace(a.runs["mtp"], matches_plain=None))


ANSWERS = [
    answered(4, 10, 10, 10, (0.5, 1.0, 0.5), [3, 3, 2, 1], 2),
    answered(6, 20, 14, 20, (1.0, 1.0, 2.5), [4] + [3] * 5, 5, False),
    answered(5, 5, 6, 5, (0.25, 0.5, 0.5), [1] * 5, 0),
]


def test_summarise_counts_each_methods_own_tokens_and_only_real_mismatches():
    summary = summarise(ANSWERS)
    # mtp: 35 tokens in 1.75 s over 15 passes; plain: 30 tokens in 2.5 s; lookup: 35 tokens in 3.5 s
    assert summary.questions == 3 and summary.tau == pytest.approx({"mtp": 35 / 15})
    assert summary.tokens_per_second == pytest.approx({"plain": 12.0, "lookup": 10.0, "mtp": 20.0})
    assert summary.speedup == pytest.approx({"fastest_plain": 20 / 12, "plain": 20 / 12, "lookup": 2.0})
    assert summary.mismatches == {"mtp": 1}
    # candidates: 5 + 13 + 0 accepted, bonus tokens left out; 2 + 5 of them from lookup
    assert summary.acceptance["accepted"] == 18 and summary.acceptance["by_source"] == {"heads": 11, "lookup": 7}
    assert summary.acceptance["at_depth"] == [9, 8, 1] and summary.acceptance["passes"] == 15
    with_heads = summarise(joined(ANSWERS, "heads", lambda i, a: Run(a.runs["mtp"].tokens, 2 * a.runs["mtp"].seconds)))
    assert with_heads.tokens_per_second["heads"] == 10.0 and with_heads.speedup["heads"] == 2.0
    assert summarise(unchecked(ANSWERS)).mismatches == {"mtp": None}  # sampling: not compared

    def plain_fast(scale: float) -> list[Answered]:
        return joined(ANSWERS, "plain_fast", lambda i, a: Run(a.runs["plain"].tokens, a.runs["plain"].seconds * scale))

    fast = summarise(plain_fast(0.5))
    assert fast.tokens_per_second["plain_fast"] == 24.0 and fast.speedup["fastest_plain"] == pytest.approx(20 / 24)
    slow = summarise(plain_fast(2.0))
    assert slow.speedup["fastest_plain"] == pytest.approx(20 / 12)  # the faster of the two, whichever it is


def test_markdown_prints_one_row_per_category_with_the_summary_figures():
    table = markdown({"a": summarise(ANSWERS[:1]), "overall": summarise(ANSWERS)}).splitlines()
    assert table[0].startswith("| category | questions | tau | mtp tok/s | plain tok/s | lookup tok/s | vs plain |")
    assert table[2] == "| a | 1 | 2.50 | 20.0 | 10.0 | 20.0 | 2.00x | 1.00x | 3 / 2 | 0 |"
    assert table[3] == "| overall | 3 | 2.33 | 20.0 | 12.0 | 10.0 | 1.67x | 2.00x | 11 / 7 | 1 |"
    sampled = markdown({"overall": summarise(unchecked(ANSWERS))})
    assert sampled.splitlines()[-1].endswith("| 2.00x | 11 / 7 | n/a (sampling) |")
    heads = joined(ANSWERS, "heads", lambda i, a: Run(a.runs["mtp"].tokens, 2 * a.runs["mtp"].seconds))
    table = markdown({"overall": summarise(heads)}).splitlines()
    assert "| lookup tok/s | heads tok/s | vs plain | vs lookup | vs heads |" in table[0]
    assert table[2] == "| overall | 3 | 2.33 | 20.0 | 12.0 | 10.0 | 10.0 | 1.67x | 2.00x | 2.00x | 11 / 7 | 1 |"
    fast = joined(ANSWERS, "plain_fast", lambda i, a: Run(a.runs["plain"].tokens, a.runs["plain"].seconds / 2))
    table = markdown({"overall": summarise(fast)}).splitlines()
    assert "| plain tok/s | plain fast tok/s | lookup tok/s | vs fastest plain | vs plain | vs plain fast |" in table[0]
    assert table[2] == "| overall | 3 | 2.33 | 20.0 | 12.0 | 24.0 | 10.0 | 0.83x | 1.67x | 0.83x | 2.00x | 11 / 7 | 1 |"
    assert "Slower than the fastest plain decoder here: overall." in markdown({"overall": summarise(fast)})
    assert acceptance_line(summarise(ANSWERS).acceptance) == (
        "mtp's 15 passes accepted a candidate at depth 1 60%, 2 53%, 3 7%; accepted candidates by drafter: heads 11, "
        "lookup 7"
    )
    assert acceptance_line(Acceptance([1, 1], {}).report()) == "mtp's 2 passes accepted no candidate"


def test_other_drafters_are_summarised_beside_mtp_each_with_its_own_tau_and_mismatches():
    answers = joined(ANSWERS, "against_1", lambda i, a: Run(a.runs["mtp"].tokens, a.runs["mtp"].seconds * 4, 35, i > 0))
    answers = joined(answers, "against_2", lambda i, a: Run(a.runs["mtp"].tokens, a.runs["mtp"].seconds / 2, 15, True))
    summary = summarise(answers)
    assert summary.tokens_per_second["against_1"] == 5.0 and summary.speedup["against_1"] == 4.0
    assert summary.tau["against_1"] == pytest.approx(35 / 105) and summary.mismatches["against_1"] == 1
    assert summary.speedup["against_2"] == 0.5
    assert summary.tau["against_2"] == pytest.approx(35 / 45) and summary.mismatches["against_2"] == 0
    table = markdown({"overall": summary}).splitlines()
    assert "| against 1 tok/s | against 2 tok/s | vs plain | vs lookup | vs against 1 | vs against 2 |" in table[0]
    assert table[0].endswith("| against 1 tau | against 1 mismatches | against 2 tau | against 2 mismatches |")
    assert table[2].endswith("| 4.00x | 0.50x | 11 / 7 | 1 | 0.33 | 1 | 0.78 | 0 |")


class FakeLlama:
    """llama-cpp-python's `Llama` as `LlamaCpp` uses it: every prompt answered with tokens 7, 8, 9, ... (2 an EOS)."""

    made = []

    def __init__(self, **settings):
        self.settings, self.resets, self.calls = settings, 0, []
        FakeLlama.made.append(self)

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **settings):
        self.calls.append((tokens, settings))
        yield from [7, 8, 9, 2, 11] if tokens == [5] else iter(range(7, 1000))


def test_llama_cpp_answers_the_same_prompt_tokens_greedily_from_an_empty_cache(monkeypatch, tmp_path):
    import torch

    from mtp.decoding.sampling import GREEDY, Sampling
    from mtp.tools.bench import LlamaCpp

    monkeypatch.setitem(sys.modules, "llama_cpp", type(sys)("llama_cpp"))
    sys.modules["llama_cpp"].Llama = FakeLlama
    (tmp_path / "base.gguf").write_bytes(b"")
    peer = LlamaCpp(str(tmp_path / "base.gguf"), threads=2, context=4096)
    assert FakeLlama.made[-1].settings == dict(
        model_path=str(tmp_path / "base.gguf"), n_ctx=4096, n_threads=2, n_threads_batch=2, verbose=False
    )
    assert peer.answer(torch.tensor([[5]]), 16, GREEDY, {2}).tokens == 3  # 7, 8, 9: stopped at the EOS
    assert peer.answer(torch.tensor([[5, 6]]), 16, Sampling(temperature=0.7, top_p=0.9), {2}).tokens == 16
    (first, greedy), (second, sampled) = FakeLlama.made[-1].calls
    assert first == [5] and second == [5, 6] and FakeLlama.made[-1].resets == 2
    assert greedy == dict(min_p=0.0, repeat_penalty=1.0, temp=0.0)
    assert sampled == dict(min_p=0.0, repeat_penalty=1.0, temp=0.7, top_k=0, top_p=0.9)


def test_llama_cpp_without_its_package_or_file_is_a_clear_error(monkeypatch, tmp_path):
    from mtp.tools.bench import LlamaCpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # (an import of it fails)
    with pytest.raises(ModuleNotFoundError, match=r"pip install '.\[peers\]'"):
        LlamaCpp(str(tmp_path / "base.gguf"), threads=2, context=4096)
    monkeypatch.setitem(sys.modules, "llama_cpp", type(sys)("llama_cpp"))
    sys.modules["llama_cpp"].Llama = FakeLlama
    with pytest.raises(FileNotFoundError, match="give --llama-cpp the base's .gguf file"):
        LlamaCpp(str(tmp_path / "missing.gguf"), threads=2, context=4096)
