"""An estimate of a training process's memory on its device at the configured batch, printed before the first step."""

import torch

from mtp.training.features import DTYPE


def saved_bytes(run) -> int:
    """Bytes of the tensors that autograd keeps for the backward pass while `run()` runs (each storage once)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def estimate(module, batch_size: int, length: int) -> dict[str, int]:
    """Bytes per device of a `DrafterModule`'s training at `batch_size` sequences of `length` tokens: the base
    model's weights as loaded; the trainable weights with their gradients and AdamW's two moments; and the peak of
    the step's activations, the larger of the base's pass (no gradients: the hidden states it keeps, one layer's
    attention and MLP) and the drafter's (its states, what autograd keeps for the backward pass, measured on one
    sequence of `length` random tokens and scaled by the batch, and one loss chunk's logits)."""
    base, drafter = module.base_model, module.drafter
    config = base.config.get_text_config(decoder=True)
    width, size = drafter.config.hidden_size, torch.finfo(base.dtype).bits // 8
    layers = drafter.config.feature_layers
    positions = batch_size * length
    trainable = [p for p in module.parameters() if p.requires_grad]
    found = {
        "base": sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()]),
        "drafter": sum(4 * p.numel() * p.element_size() for p in trainable)  # weights, gradients, AdamW's 2 moments
        + sum(t.numel() * t.element_size() for t in drafter.buffers()),
    }
    states = positions * (len(layers) + 1) * width  # values of the hidden states the drafter reads
    if module.features is None:  # the base's pass: every layer's output when some are read, one layer's work
        kept = positions * width * ((config.num_hidden_layers + 1) if layers else 1) * size
        attention = batch_size * config.num_attention_heads * length * length * 2 * size  # scores, softmax
        mlp = positions * (3 * config.intermediate_size + 4 * width) * size
        first = kept + attention + mlp + states * size
    else:  # read from disk, then in the compute dtype
        first = states * (DTYPE.itemsize + size)
    device = next(drafter.parameters()).device
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(0)
        sample = torch.randn(1, length, (len(layers) + 1) * width, device=device, dtype=base.dtype)
        input_ids = torch.randint(drafter.config.vocab_size, (1, length), device=device)
    keep = torch.ones(1, length, dtype=torch.bool, device=device)
    embed = base.get_input_embeddings()
    with module.trainer.precision_plugin.forward_context():  # as a training step runs it (autocast under *-mixed)
        drafter_pass = batch_size * saved_bytes(
            lambda: drafter.teacher_forced(sample[..., -width:], sample[..., :-width], input_ids, keep, embed)
        )
    rows = drafter.config.vocab_size if drafter.config.draft_vocab is None else len(drafter.config.draft_vocab)
    chunk = min(positions, module.loss.chunk)
    loss = 4 * len(module.weights) * chunk * rows * 4  # float32 logits, their softmax, the teacher's two
    second = states * size + len(module.weights) * positions * width * 4 + drafter_pass + loss
    found["activations"] = max(first, second)
    found["total"] = sum(found.values())
    return found


def memory_line(found: dict[str, int], batch_size: int, length: int) -> str:
    """One line of `estimate`'s figures."""
    gb = {key: f"{value / 1e9:.2f} GB" if value >= 1e9 else f"{value / 1e6:.1f} MB" for key, value in found.items()}
    return (
        f"Memory per device (estimate): {gb['total']}: base {gb['base']}, drafter {gb['drafter']} (weights, "
        f"gradients, AdamW state), activations {gb['activations']} at {batch_size} x {length} tokens"
    )
