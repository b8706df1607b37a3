"""Write the tiny test model's tokenizer (512-token byte-level BPE with a ChatML chat template).

python scripts/make_tiny_tokenizer.py   # rewrites configs/models/tiny-llama/tokenizer*.json
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "configs" / "models" / "tiny-llama"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in config.json
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def main() -> None:
    texts = [
        turn["content"] for line in (ROOT / "data" / "tiny_chat.jsonl").open() for turn in json.loads(line)["messages"]
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=SPECIAL[1], eos_token=SPECIAL[2], pad_token=SPECIAL[0]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(FOLDER)


if __name__ == "__main__":
    main()
