"""What a training run is asked for, in three groups of a recipe's `model:` section: the drafter to build
(`model.drafter`), the loss it learns from (`model.loss`) and the optimizer's schedule (`model.optim`). Each checks
its own values as it is made."""

from dataclasses import dataclass

from mtp.training.loss import default_weights


@dataclass(frozen=True)
class DrafterSettings:
    """The drafter that trains."""

    head_type: str = "medusa"
    """`medusa` (head k reads the hidden state at t), `hydra` (also the base model's input embeddings of the true
    tokens t+1 .. t+k+1, by teacher forcing; the candidate path when decoding), `eagle` (a feature-level drafter
    unrolled over its own states), or another registered kind."""
    num_heads: int = 4
    """Head (or step) k predicts the token k+2 positions ahead."""
    num_layers: int = 1
    """Residual blocks per head."""
    lm_head: str = "shared"
    """`shared` (the base's frozen lm_head) or `own` (a trainable copy per head)."""
    feature_layers: list[int] | None = None
    """The base model's hidden states the drafter reads beside the last (0: the input embeddings, i: the output of
    decoder layer i - 1); None: its kind's (`eagle`: a low, a middle and a high one, 2, L // 2 and L - 3 of L layers,
    as EAGLE-3 reads them)."""
    draft_vocab: int = 0
    """The drafter guesses among the `draft_vocab` most frequent target tokens of the training data only (saved with
    it): training and decoding project onto these rows of the lm_head alone, and a target outside them is a miss;
    0: the whole vocabulary."""
    init: str | None = None
    """Start from the drafter in this folder, of the same kind and base, and its draft vocabulary (for example
    frozen-base heads, trained on with `lora`: Medusa-2's two stages)."""

    def __post_init__(self):
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab={self.draft_vocab}: use 0 (the whole vocabulary) or a number of tokens.")


@dataclass(frozen=True)
class Loss:
    """What the drafter learns to predict, and how its heads' losses add up."""

    decay: float = 0.8
    """Head k's loss weight is decay**k, unless `weights` is given."""
    weights: list[float] | None = None
    """One weight per head."""
    teacher: bool = False
    """Learn the base model's distribution for token t+k+2 (its own prediction at t+k+1, over the draft vocabulary if
    there is one; soft cross-entropy) instead of the token itself."""
    feature_noise: float = 0.0
    """For `eagle`: standard deviation of the Gaussian noise added to the base model's features in training (0:
    none), so that the drafter learns to read imperfect ones, as it must its own."""
    feature_loss: float = 0.0
    """The weight of a feature regression added to the loss (0: none): the smooth-L1 distance between the state each
    step projects (`eagle`: its normed output) and the base model's last hidden state that scores the same token
    (what the base's lm_head reads), as EAGLE trains its features."""
    chunk: int = 1024
    """Positions whose logits the loss computes at once: each chunk's logits (K x chunk x the vocabulary or draft
    vocabulary, float32) are dropped after its loss and computed again in the backward pass, so the loss's peak
    memory is one chunk's, whatever the batch."""

    def __post_init__(self):
        if self.feature_loss < 0:
            raise ValueError(f"feature_loss={self.feature_loss}: give a weight >= 0 (0: no feature regression).")
        if self.chunk < 1:
            raise ValueError(f"loss chunk={self.chunk}: give the positions a chunk of the loss holds, at least 1.")

    def head_weights(self, num_heads: int) -> list[float]:
        """Each head's loss weight: `weights`, or decay**k."""
        if self.weights is None:
            return default_weights(num_heads, self.decay)
        if len(self.weights) != num_heads:
            raise ValueError(f"loss weights has {len(self.weights)} entries for {num_heads} heads: give one per head.")
        return list(self.weights)


@dataclass(frozen=True)
class Optim:
    """AdamW with a linear warmup to the peak learning rate, then a cosine decay to 0 at the last step."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    warmup_steps: int = 50
    """Linear warmup steps."""
