#!/usr/bin/env bash
# The GPU check, for the day a machine with CUDA is lent (nothing but this repository and its installed packages
# needed; under 8 minutes on one GPU): the tiny recipe trained on the GPU, then the shipped drafter sized and
# benchmarked on the packaged SmolLM2 in CUDA (bfloat16): tau, the step costs, the tree and lookup that loading
# chose from the costs it measured there, and the speedups against the fastest plain decoder, all printed. Results go to runs/gpu-check/ (or $OUT when set). MTP_DEVICE=cpu runs the same steps
# on the CPU, smaller (CI does, so that the script cannot rot).
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
device=${MTP_DEVICE:-cuda}
out=${OUT:-runs/gpu-check}
if [ "$device" = cuda ]; then
    accelerator=gpu dtype=bfloat16 nodes=64 questions=16 tokens=128
    $python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: run with MTP_DEVICE=cpu'"
    $python -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)"
else
    accelerator=cpu dtype=float32 nodes=3 questions=1 tokens=16
fi
mkdir -p "$out"

echo "== 1/3 The tiny recipe on $device"
$python train.py fit --config configs/tiny.yaml --trainer.accelerator $accelerator --trainer.devices 1 \
    --trainer.enable_progress_bar false --trainer.logger.init_args.save_dir "$out/tiny"

echo "== 2/3 Sizing the shipped heads on $device ($dtype, trees up to $nodes nodes)"
rm -rf "$out/heads" && cp -r heads/smollm2-135m-instruct "$out/heads"
$python -m mtp.tools.sizing --drafter "$out/heads" --device "$device" --dtype $dtype --max-nodes $nodes --remeasure

echo "== 3/3 mtp.tools.bench: $questions MT-Bench first turns, $tokens new tokens, against the fastest plain decoder"
$python -m mtp.tools.bench --drafter "$out/heads" --questions data/mt_bench.jsonl --limit $questions \
    --max-new-tokens $tokens --device "$device" --dtype $dtype --out "$out/bench.json"
