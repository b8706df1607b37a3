"""How far the adapter trained with the heads moved the base model (`DrafterModule(lora=...)`): on the held-out
answers of their training data, the adapted model against the original (the same network with its adapters off):
teacher-forced top-1 agreement and mean KL(original || adapted) of the next-token distributions at every answer
token, and the share of held-out prompts whose greedy answers are identical over --max-new-tokens tokens.

    python -m mtp.tools.drift --drafter DRAFTER --data TRAINING_DATA [--val-data ANSWERS] [--prompts 20]
        [--max-new-tokens 128]
"""

import argparse
import json

import torch
from torch.nn import functional as F

from mtp.drafters.contract import Drafter, load_with_base
from mtp.tools.cli import user_errors
from mtp.training.data import add_held_out_arguments, held_out
from mtp.training.lora import divergence


@torch.no_grad()
def drift(heads_path: str, examples: list, prompts: int, max_new_tokens: int, device: str = "cpu") -> dict:
    """`agreement` and `kl` over the answer tokens of `examples` ((ids, mask, ...)), `identical` over the greedy
    answers to the prompts of the first `prompts` of them, and the counts they are over."""
    from peft import PeftModel

    heads, base, tokenizer = load_with_base(heads_path, device=device, adapt=False)
    if not heads.config.adapter:
        raise ValueError(f"{heads_path} has no adapter: these heads decode with the original base, nothing moved.")
    model = PeftModel.from_pretrained(base, heads.folder).eval()
    agree = kl = positions = same = 0
    prompts = min(prompts, len(examples))
    for i, (ids, mask, *_) in enumerate(examples):
        ids, at = ids[None].to(device), F.pad(mask[1:], (0, 1)).to(device)  # position t predicts answer token t+1
        adapted = model(input_ids=ids).logits[0, at].float().log_softmax(-1)  # (N, V)
        with model.disable_adapter():
            original = model(input_ids=ids).logits[0, at].float().log_softmax(-1)
        divergent, agreeing = divergence(adapted, original)
        kl, agree = kl + float(divergent), agree + int(agreeing)
        positions += len(adapted)
        if i < prompts:  # the prompt: everything before the first answer token
            prompt = ids[:, : int(mask.int().argmax())]
            settings = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(prompt))
            answer = model.generate(input_ids=prompt, **settings)
            with model.disable_adapter():
                same += torch.equal(answer, model.generate(input_ids=prompt, **settings))
    return {
        "agreement": agree / max(positions, 1),
        "kl": kl / max(positions, 1),
        "answer_tokens": positions,
        "identical": same / max(prompts, 1),
        "prompts": prompts,
    }


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", "--heads", required=True, help="drafter folder with an adapter")
    add_held_out_arguments(parser)
    parser.add_argument("--prompts", type=int, default=20, help="held-out prompts answered greedily by both models")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    examples = held_out(args, Drafter.from_pretrained(args.drafter).config.base_model).val_examples
    found = drift(args.drafter, examples, args.prompts, args.max_new_tokens, args.device)
    print(
        f"Over {found['answer_tokens']} held-out answer tokens: top-1 agreement {found['agreement']:.2%}, mean KL "
        f"{found['kl']:.4f} nats; identical greedy answers ({args.max_new_tokens} tokens): {found['identical']:.0%} "
        f"of {found['prompts']} prompts"
    )
    print(json.dumps(found))


if __name__ == "__main__":
    main()
