"""The memory estimate that training prints before its first step, against the peak measured on this CPU
(benchmarks/train_memory.py: a few steps on the longest batches, the resident memory over what the process held
before the model was made)."""

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_BASE, TINY_CHAT


def measured(*options: str) -> tuple[float, float]:
    """(estimate, measured peak) in MB."""
    command = [sys.executable, "benchmarks/train_memory.py", "--steps", "2", *options]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    total = re.search(r"Memory per device \(estimate\): ([\d.]+) (MB|GB)", done.stdout)
    peak = re.search(r"measured peak .*: ([\d,]+) MB", done.stdout)
    return float(total[1]) * (1000 if total[2] == "GB" else 1), float(peak[1].replace(",", ""))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hydra", "eagle"])
def test_the_measured_peak_is_the_estimate_to_a_third_more_for_the_135m_model(kind):
    """Hydra heads with the base in every step, the eagle drafter reading 3 layers: measured 1.20-1.21x the
    estimate on a 2-core EPYC, 1.14x and 1.16x on the 2-core Zen 4 EPYC (the allocator's and Lightning's own memory
    are not estimated). Never below it: an estimate that counted the base's weights twice (peaks 0.79x and 0.91x of
    it) fails both; the earlier bound, 0.8x, let the eagle one pass."""
    estimate, peak = measured(
        "--data", "data/distilled", "--head_type", kind, "--batch_size", "8", "--max_length", "256"
    )
    assert estimate <= peak <= 4 / 3 * estimate, (estimate, peak)


@pytest.mark.slow
def test_the_estimate_for_the_tiny_model_is_within_the_processes_fixed_costs():
    """A few MB of weights and activations: what Lightning and the allocator hold (some 30 MB here) dominates."""
    estimate, peak = measured(
        "--base_model", TINY_BASE, "--data", TINY_CHAT, "--draft_vocab", "60", "--batch_size", "2", "--max_length", "64"
    )
    assert 0 < estimate < peak < estimate + 100, (estimate, peak)
