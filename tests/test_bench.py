import json
import subprocess
import sys

import pytest

from tests.conftest import DATA, ROOT
from tests.test_stopping import save_random_heads


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.7", "--top-p", "0.9", "--seed", "0"]],
                         ids=["greedy", "sampling"])  # fmt: skip
def test_bench_writes_its_json_and_table_and_finds_no_mismatch(tmp_path, sampling):
    path, _, _ = save_random_heads(tmp_path, "own")
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "mtp.bench", "--heads", path, "--questions", str(DATA / "mt_bench.jsonl"),
               "--limit", "3", "--max-new-tokens", "12", "--out", str(out), *sampling]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report) == {"settings", "summary", "questions"} and len(report["questions"]) == 3
    assert list(report["summary"]) == ["writing", "roleplay", "reasoning", "overall"]  # one per category first
    overall = report["summary"]["overall"]
    assert overall["mismatches"] == (None if sampling else 0) and overall["questions"] == 3 and overall["tau"] >= 1
    assert {"speedup_vs_plain", "speedup_vs_lookup", "mtp_tokens_per_second"} <= set(overall)
    # greedy: every output equals plain generate's; sampling: outputs differ by chance, nothing is compared
    assert all(row["matches_plain"] is (True if not sampling else None) for row in report["questions"])
    assert report["settings"]["temperature"] == (0.7 if sampling else 0.0)
    assert out.with_suffix(".md").read_text().startswith("| category |") and "| overall | 3 |" in done.stdout
