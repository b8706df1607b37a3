#!/usr/bin/env bash
# The whole loop (16 minutes from a fresh clone on a 2-core AMD EPYC, set-up and the first compile included):
# set up (or reuse) the environment; train Hydra heads briefly on the packaged SmolLM2's own answers (configs/smollm2-demo.yaml; extra arguments go
# to train.py); decode one prompt with the shipped heads, streaming; then time them against the fastest plain
# decoder on one MT-Bench question per category, each decoder twice per question (its faster time kept).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python=.venv/bin/python

echo "== 1/3 Training 4 Hydra heads on data/demo_answers.jsonl"
$python train.py fit --config configs/smollm2-demo.yaml --trainer.enable_progress_bar false "$@"
heads=$(ls -td runs/smollm2-demo/lightning_logs/version_*/heads | head -1)

echo "== 2/3 Decoding with the shipped heads (heads/smollm2-135m-instruct), streamed as accepted"
$python decode.py --prompt "Explain in three sentences why the sky is blue." --max-new-tokens 96 --stream

echo "== 3/3 Tau and speed against the fastest plain decoder, one MT-Bench question per category, in one run"
$python -m mtp.tools.bench --drafter heads/smollm2-135m-instruct --questions data/mt_bench.jsonl --limit 8 \
    --max-new-tokens 64 --repeat 2 --out runs/demo/bench.json

cat <<NEXT

The heads you just trained: $heads
Next, with them (or with heads/smollm2-135m-instruct, the shipped ones):
  $python -m mtp.tools.sizing --drafter $heads          # size their tree for this machine
  $python decode.py --drafter $heads --stream       # chat with them
  $python -m mtp.tools.bench --drafter $heads --questions data/mt_bench.jsonl --limit 8 --max-new-tokens 128
NEXT
$python - <<'FIGURE'
import json
run = json.load(open("runs/demo/bench.json"))
overall, settings = run["summary"]["overall"], run["settings"]
print(f"\nMeasured here ({settings['device_name']}), mtp with the shipped heads ({settings['plan']}): "
      f"tau {overall['tau']['mtp']:.2f}, {overall['speedup']['fastest_plain']:.2f}x the fastest plain decoder.")
acceptance = overall["acceptance"]
print("Share of passes that accepted a candidate at depth 1, 2, ...:",
      ", ".join(f"{rate:.0%}" for rate in acceptance["rate_at_depth"]) or "none", "; by drafter:", acceptance["by_source"])
FIGURE
