import json
import subprocess
import sys

from tests.conftest import ROOT, SHARED_DATA
from tests.test_stopping import save_random_heads


def test_bench_writes_its_json_and_table_and_finds_no_mismatch(tmp_path):
    path, _, _ = save_random_heads(tmp_path, "own")
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "mtp.bench", "--heads", path, "--questions", str(SHARED_DATA / "mt_bench.jsonl"),
               "--limit", "3", "--max-new-tokens", "12", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report) == {"settings", "summary", "questions"} and len(report["questions"]) == 3
    assert list(report["summary"]) == ["writing", "roleplay", "reasoning", "overall"]  # one per category first
    overall = report["summary"]["overall"]
    assert overall["mismatches"] == 0 and overall["questions"] == 3 and overall["tau"] >= 1
    assert {"speedup_vs_greedy", "speedup_vs_lookup", "mtp_tokens_per_second"} <= set(overall)
    assert all(row["matches_greedy"] for row in report["questions"])
    assert out.with_suffix(".md").read_text().startswith("| category |") and "| overall | 3 |" in done.stdout
