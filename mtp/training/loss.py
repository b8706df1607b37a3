"""The offset rule (head k at position t predicts token t+k+2), the weighted multi-head loss, and the accuracy of each
head's ranked guesses."""

import torch
from torch.nn import functional as F
from torchmetrics import Metric

IGNORE = -100
RANKS = 10  # calibration: how often each head's rank-r guess is right, r < RANKS


def head_offset(k: int) -> int:
    """How far ahead head k predicts: the base lm_head predicts t+1, so head k predicts t+k+2."""
    return k + 2


def head_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Targets of every head at every position, IGNORE where the target is masked or past the end.

    Args:
        input_ids: (B, T) token ids.
        loss_mask: (B, T) bool, True where a token is a training target (assistant tokens, not padding).
        num_heads: K.

    Returns:
        (K, B, T) targets: `targets[k, b, t] = input_ids[b, t + k + 2]` where that token is in the loss.
    """
    batch, length = input_ids.shape
    targets = input_ids.new_full((num_heads, batch, length), IGNORE)  # (K, B, T)
    for k in range(num_heads):
        offset = head_offset(k)
        if offset < length:
            future = input_ids[:, offset:]  # (B, T - offset)
            targets[k, :, : length - offset] = future.masked_fill(~loss_mask[:, offset:], IGNORE)
    return targets


def shifted(hidden: torch.Tensor, offset: int) -> torch.Tensor:
    """(B, T, H) -> (B, T, H): [b, t] is hidden[b, t+offset] (zeros past the end)."""
    return F.pad(hidden, (0, 0, 0, offset))[:, offset:]


def default_weights(num_heads: int, decay: float = 0.8) -> list[float]:
    """Default weight of head k: decay**k (later heads are less accurate and matter less for acceptance)."""
    return [decay**k for k in range(num_heads)]


def summed_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None = None
) -> torch.Tensor:
    """Per head, the cross-entropy summed over its unmasked targets: (K,); `weighted` makes the loss of them.

    Args:
        logits: (K, N, V) head logits at N positions.
        targets: (K, N) targets, IGNORE where masked.
        teacher: (K, N, V) logits of the distribution to learn instead of the target tokens (soft
            cross-entropy), at the same unmasked positions.
    """
    flat = logits.flatten(0, 1).float()  # (K N, V)
    if teacher is None:
        per_head = F.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE, reduction="none")
    else:
        soft = teacher.flatten(0, 1).float().softmax(-1)  # (K N, V)
        per_head = F.cross_entropy(flat, soft, reduction="none").masked_fill(targets.flatten() == IGNORE, 0.0)
    return per_head.view(targets.shape).sum(1)  # (K,)


def weighted(sums: torch.Tensor, targets: torch.Tensor, weights: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted sum over heads of each head's mean loss over its unmasked targets (K, N), and the (K,) means,
    from the heads' summed losses (K,); a head with no target in the batch contributes 0."""
    per_head = sums / (targets != IGNORE).sum(1).clamp(min=1)  # (K,)
    return (per_head * per_head.new_tensor(weights)).sum(), per_head


def feature_regression(outputs: torch.Tensor, wanted: torch.Tensor, targets: torch.Tensor, weights: list[float]):
    """Weighted sum over steps of the mean smooth-L1 distance (per hidden unit) between each step's feature and the
    one it should be, at the positions where the step has a target.

    Args:
        outputs: (K, N, H) the drafter's features.
        wanted: (K, N, H) the features to regress onto.
        targets: (K, N) the steps' targets, IGNORE where masked.
        weights: K weights.
    """
    distance = F.smooth_l1_loss(outputs.float(), wanted.float(), reduction="none").mean(-1)  # (K, N)
    valid = targets != IGNORE  # (K, N)
    per_step = (distance * valid).sum(1) / valid.sum(1).clamp(min=1)  # (K,)
    return (per_step * per_step.new_tensor(weights)).sum()


class RankAccuracy(Metric):
    """Per head, the fraction of positions where the head's rank-r guess is the target, for r < RANKS."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.add_state("hits", torch.zeros(num_heads, RANKS), dist_reduce_fx="sum")
        self.add_state("positions", torch.zeros(num_heads), dist_reduce_fx="sum")

    def update(self, hits: torch.Tensor, valid: torch.Tensor) -> None:
        """hits (K, N, RANKS): head k's rank-r guess at position n is the target; valid (K, N): n has a target."""
        self.hits += (hits & valid.unsqueeze(-1)).sum(1).float()
        self.positions += valid.sum(1).float()

    def compute(self) -> torch.Tensor:
        return self.hits / self.positions.clamp(min=1).unsqueeze(-1)  # (K, RANKS)


def draft_columns(targets: torch.Tensor, draft_vocab: list[int], vocab_size: int) -> torch.Tensor:
    """Each target token's column among the draft vocabulary's logits; IGNORE where it is IGNORE or outside."""
    columns = targets.new_full((vocab_size,), IGNORE)  # (V,)
    columns[draft_vocab] = torch.arange(len(draft_vocab), device=targets.device)
    return columns[targets.clamp(min=0)].masked_fill(targets == IGNORE, IGNORE)  # targets' shape
