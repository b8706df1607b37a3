"""LightningModule: a frozen base model plus trainable heads, the multi-head loss and per-head accuracy."""

import math
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics import MeanMetric, Metric

from mtp.base import DEFAULT_BASE, load_base
from mtp.heads import HEAD_TYPES, HeadsConfig, base_identity
from mtp.loss import IGNORE, default_weights, following_tokens, head_targets, heads_loss, shifted

TOP_K = (1, 5)
RANKS = 10  # calibration: how often each head's rank-r guess is right, r < RANKS
# Lightning warns about modules in eval mode when training starts: the frozen base is, on purpose.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode")


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


class HeadsModule(L.LightningModule):
    def __init__(
        self,
        base_model: str = DEFAULT_BASE,
        num_heads: int = 4,
        num_layers: int = 1,
        lm_head: str = "shared",
        loss_decay: float = 0.8,
        loss_weights: list[float] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 50,
        cache_hidden: bool = False,
        draft_vocab: int = 0,
        head_type: str = "medusa",
        teacher: bool = False,
    ):
        """Medusa-style heads trained by teacher forcing on a frozen base model.

        Args:
            base_model: the base model (see `mtp.base.load_base`): packaged default, folder, .gguf, .json, hub id.
            num_heads: head k predicts the token k+2 positions ahead.
            num_layers: residual blocks per head.
            lm_head: `shared` (the base's frozen lm_head) or `own` (a trainable copy per head).
            loss_decay: head k's loss weight is loss_decay**k, unless loss_weights is given.
            loss_weights: one weight per head.
            lr: peak AdamW learning rate, reached after warmup_steps, then cosine decay to 0.
            weight_decay: AdamW weight decay.
            warmup_steps: linear warmup steps.
            cache_hidden: keep the base model's hidden states of each example (in CPU memory, 4 x hidden size
                bytes per token in float32) after its first pass, so that later epochs run the heads alone.
                On the default model on a CPU the base forward is about 40% of a training step.
            draft_vocab: the heads guess among the `draft_vocab` most frequent target tokens of the training data
                only (saved with the heads): training and decoding project onto these rows of the lm_head alone,
                and a target outside them is a miss; 0: the whole vocabulary.
            head_type: `medusa` (head k reads the hidden state at t) or `hydra` (also the base model's input
                embeddings of the true tokens t+1 .. t+k+1, by teacher forcing; the candidate path when decoding).
            teacher: learn the base model's distribution for token t+k+2 (its own prediction at t+k+1, over the
                draft vocabulary if there is one; soft cross-entropy) instead of the token itself.
        """
        super().__init__()
        self.save_hyperparameters()
        weights = loss_weights if loss_weights is not None else default_weights(num_heads, loss_decay)
        if len(weights) != num_heads:
            raise ValueError(f"loss_weights has {len(weights)} entries for {num_heads} heads: give one per head.")
        self.weights = weights
        if draft_vocab < 0:
            raise ValueError(f"draft_vocab={draft_vocab}: use 0 (the whole vocabulary) or a number of tokens.")
        self.base_model, tokenizer = load_base(base_model)
        self.base_model.requires_grad_(False)
        lm_head_weight = self.base_model.get_output_embeddings().weight
        identity = base_identity(base_model, self.base_model, tokenizer)
        config = HeadsConfig(
            num_heads=num_heads, num_layers=num_layers, lm_head=lm_head, head_type=head_type, **identity
        )
        self.heads = HEAD_TYPES[config.head_type](config, lm_head_weight.detach())
        self.hidden_cache: dict[int, torch.Tensor] = {}  # example index -> (T, H), when cache_hidden
        self.strict_loading = False  # checkpoints hold the heads only; the base comes from base_model
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_head{k}_top{top}": MeanMetric()
                for stage in ("train", "val")
                for k in range(num_heads)
                for top in TOP_K
            }
        )
        self.rank_accuracy = RankAccuracy(num_heads)  # over each validation run; saved with the heads

    def train(self, mode: bool = True):
        super().train(mode)
        self.base_model.eval()  # frozen: no dropout, whatever Lightning asks of the module
        return self

    @torch.no_grad()
    def hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The base model's last hidden states (B, T, H), from the cache when every example is in it."""
        indices, lengths = batch["index"].tolist(), batch["attention_mask"].sum(1).tolist()
        if self.hparams.cache_hidden and all(index in self.hidden_cache for index in indices):
            cached = [self.hidden_cache[index].to(self.device) for index in indices]
            hidden = cached[0].new_zeros(*batch["input_ids"].shape, cached[0].shape[-1])  # (B, T, H), right-padded
            for row, states in enumerate(cached):
                hidden[row, : len(states)] = states
            return hidden
        hidden = self.base_model.get_decoder()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).last_hidden_state  # (B, T, H)
        if self.hparams.cache_hidden:
            for row, (index, length) in enumerate(zip(indices, lengths, strict=True)):
                self.hidden_cache[index] = hidden[row, :length].to("cpu", copy=True)
        return hidden

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        hidden = self.hidden_states(batch)  # (B, T, H)
        targets = head_targets(batch["input_ids"], batch["loss_mask"], len(self.weights))  # (K, B, T)
        keep = (targets != IGNORE).any(0)  # (B, T): positions where some head has a target
        targets = targets[:, keep]  # (K, N)
        lm_head, num_heads = self.base_model.get_output_embeddings(), len(self.weights)
        following = None  # (N, K, H) the input embeddings of the true tokens t+1 .. t+K, for heads that read them
        if self.heads.reads_path:
            following = self.base_model.get_input_embeddings()(following_tokens(batch["input_ids"], num_heads)[keep])
        draft = self.heads.config.draft_vocab
        if draft is None:
            logits, scored = self.heads(hidden[keep], lm_head, following=following), targets  # (K, N, V), (K, N)
        else:  # the heads learn to rank the draft tokens only, as they will when decoding
            logits = self.heads.draft_logits(hidden[keep], lm_head, following=following)  # (K, N, D)
            scored = draft_columns(targets, draft, self.heads.config.vocab_size)  # (K, N)
        teacher = None
        if self.hparams.teacher:  # head k's target: the base model's own prediction at t+k+1, for token t+k+2
            before = torch.stack([shifted(hidden, k + 1)[keep] for k in range(num_heads)])  # (K, N, H)
            rows = lm_head.weight if draft is None else lm_head.weight[torch.tensor(draft, device=hidden.device)]
            teacher = before @ rows.T  # (K, N, V or D)
        loss, per_head = heads_loss(logits, targets if teacher is not None else scored, self.weights, teacher)
        batch_size = batch["input_ids"].shape[0]
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=batch_size, sync_dist=stage == "val")
        # hits[k, n, r]: head k's rank-r guess at position n is the target (MulticlassAccuracy over a
        # 49k-class vocabulary is orders of magnitude slower than this); a target outside the draft vocabulary
        # is scored IGNORE, matches no column and counts as a miss
        hits = logits.detach().topk(RANKS, dim=-1).indices == scored.unsqueeze(-1)  # (K, N, RANKS)
        if stage == "val":
            self.rank_accuracy.update(hits, targets != IGNORE)
        for k in range(len(self.weights)):
            self.log(f"{stage}/head{k}_loss", per_head[k], batch_size=batch_size, sync_dist=stage == "val")
            valid = targets[k] != IGNORE  # (N,)
            for top in TOP_K:
                metric = self.metrics[f"{stage}_head{k}_top{top}"]
                metric(hits[k, valid, :top].any(-1).float())  # forward: this batch's value, and accumulate
                self.log(
                    f"{stage}/head{k}_top{top}", metric, prog_bar=top == 1 and stage == "val", batch_size=batch_size
                )
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def on_fit_start(self) -> None:
        if self.hparams.draft_vocab:
            examples = self.trainer.datamodule.train_examples
            targets = torch.cat([ids[mask] for ids, mask, _ in examples])  # every target token of the training split
            counts = torch.bincount(targets, minlength=self.heads.config.vocab_size)  # (V,)
            top = counts.topk(min(self.hparams.draft_vocab, len(counts)))
            self.heads.config.draft_vocab = top.indices.tolist()
            rank_zero_info(
                f"Draft vocabulary: the {len(top.indices)} most frequent tokens cover "
                f"{float(top.values.sum() / counts.sum()):.1%} of the training targets"
            )

    def on_validation_epoch_start(self) -> None:
        self.rank_accuracy.reset()

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:  # the last validation run calibrates the saved heads
            self.heads.config.calibration = [
                [round(a, 5) for a in head] for head in self.rank_accuracy.compute().tolist()
            ]

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.heads.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = min(self.hparams.warmup_steps, total - 1)

        def scale(step: int) -> float:  # linear warmup, then cosine decay to 0 at the last step
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / max(total - warmup, 1)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def state_dict(self, *args, **kwargs):
        """Heads (and metric state) only: the frozen base is reloaded from base_model, never checkpointed."""
        state = super().state_dict(*args, **kwargs)
        return {key: value for key, value in state.items() if not key.startswith("base_model.")}

    def on_fit_end(self) -> None:
        if self.trainer.fast_dev_run:  # a smoke run: like Lightning's logs and checkpoints, nothing is written
            return
        folder = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "heads"  # log_dir: a collective call
        if self.trainer.is_global_zero:
            self.heads.save_pretrained(folder)
            metrics = self.trainer.callback_metrics
            rank_zero_info(f"Heads saved to {folder}")
            for k in range(len(self.weights)):
                found = [
                    f"top-{top} {metrics[f'val/head{k}_top{top}']:.3f}"
                    for top in TOP_K
                    if f"val/head{k}_top{top}" in metrics
                ]
                rank_zero_info(f"head {k} (token t+{k + 2}) validation accuracy: {', '.join(found) or 'not measured'}")
