#!/usr/bin/env bash
# The GPU check, for the day a machine with CUDA is lent (nothing but this repository and its installed packages
# needed; under 8 minutes on one GPU): the tiny recipe trained on the GPU, a few bf16-mixed steps of the eagle
# drafter on the packaged SmolLM2 with its peak GPU memory against the printed estimate and its tokens/s, then the
# shipped drafter sized and
# benchmarked on the packaged SmolLM2 in CUDA (bfloat16): eager and compiled verification passes over 1 to 64
# nodes, tau, the step costs, the tree and lookup that loading
# chose from the costs it measured there, and the speedups against the fastest plain decoder, all printed. Results go to runs/gpu-check/ (or $OUT when set). MTP_DEVICE=cpu runs the same steps
# on the CPU, smaller (CI does, so that the script cannot rot).
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
device=${MTP_DEVICE:-cuda}
out=${OUT:-runs/gpu-check}
if [ "$device" = cuda ]; then
    accelerator=gpu dtype=bfloat16 nodes=64 questions=16 tokens=128 precision=bf16-mixed
    passes=(--nodes 1 2 4 8 16 32 64)
    train=(--data data/distilled --batch_size 8 --max_length 512 --steps 6)
    $python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: run with MTP_DEVICE=cpu'"
    $python -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)"
else
    accelerator=cpu dtype=float32 nodes=3 questions=1 tokens=16 precision=32-true
    passes=(--nodes 1 4 --base-model configs/models/tiny-llama/config.json --context 32 --repeats 3 --no-templates)
    train=(--base_model configs/models/tiny-llama/config.json --data data/tiny_chat.jsonl --draft_vocab 60
           --batch_size 2 --max_length 64 --steps 2)
fi
mkdir -p "$out"

echo "== 1/5 The tiny recipe on $device"
$python train.py fit --config configs/tiny.yaml --trainer.accelerator $accelerator --trainer.devices 1 \
    --trainer.enable_progress_bar false --trainer.logger.init_args.save_dir "$out/tiny"

echo "== 2/5 Training memory and speed: the eagle drafter on $device ($precision), peak against the estimate"
$python benchmarks/train_memory.py --head_type eagle --num_heads 3 --device "$device" --precision $precision "${train[@]}"

echo "== 3/5 Eager against compiled verification passes on $device ($dtype)"
$python benchmarks/compiled_steps.py --device "$device" --dtype $dtype "${passes[@]}"

echo "== 4/5 Sizing the shipped heads on $device ($dtype, trees up to $nodes nodes)"
rm -rf "$out/heads" && cp -r heads/smollm2-135m-instruct "$out/heads"
$python -m mtp.tools.sizing --drafter "$out/heads" --device "$device" --dtype $dtype --max-nodes $nodes --remeasure

echo "== 5/5 mtp.tools.bench: $questions MT-Bench first turns, $tokens new tokens, against the fastest plain decoder"
$python -m mtp.tools.bench --drafter "$out/heads" --questions data/mt_bench.jsonl --limit $questions \
    --max-new-tokens $tokens --device "$device" --dtype $dtype --out "$out/bench.json"
