"""LightningModule: a frozen base model plus trainable heads, the multi-head loss and per-head accuracy."""

import math
import warnings
from dataclasses import asdict
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torchmetrics import MeanMetric

from mtp.base import DEFAULT_BASE, compute_dtype, load_base
from mtp.drafters.contract import Drafter, DrafterConfig, base_identity, weights_fingerprint
from mtp.training.features import Features, backbone, manifest, write_features
from mtp.training.lora import Lora, divergence, with_adapters
from mtp.training.loss import (
    IGNORE,
    RANKS,
    RankAccuracy,
    default_weights,
    draft_columns,
    feature_regression,
    head_targets,
    shifted,
    summed_cross_entropy,
    weighted,
)
from mtp.training.memory import estimate, memory_line

TOP_K = (1, 5)
# Lightning warns about modules in eval mode when training starts: the frozen base is, on purpose.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode")


class DrafterModule(L.LightningModule):
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
        draft_vocab: int = 0,
        head_type: str = "medusa",
        teacher: bool = False,
        lora: Lora | None = None,
        init_heads: str | None = None,
        feature_layers: list[int] | None = None,
        feature_noise: float = 0.0,
        feature_loss: float = 0.0,
        features: str | None = None,
        loss_chunk: int = 1024,
        precision: str = "32-true",
    ):
        """Medusa-style heads trained by teacher forcing on a frozen base model (or, with `lora`, on the base
        model trained through low-rank adapters at the same time).

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
            draft_vocab: the heads guess among the `draft_vocab` most frequent target tokens of the training data
                only (saved with the heads): training and decoding project onto these rows of the lm_head alone,
                and a target outside them is a miss; 0: the whole vocabulary.
            head_type: `medusa` (head k reads the hidden state at t) or `hydra` (also the base model's input
                embeddings of the true tokens t+1 .. t+k+1, by teacher forcing; the candidate path when decoding).
            teacher: learn the base model's distribution for token t+k+2 (its own prediction at t+k+1, over the
                draft vocabulary if there is one; soft cross-entropy) instead of the token itself.
            lora: train LoRA adapters of the base model with the heads (see `Lora`); None: the base stays frozen.
            init_heads: start from the heads in this folder, of the same kind and base, and their draft vocabulary
                (for example frozen-base heads, trained on with `lora`: Medusa-2's two stages).
            feature_layers: the base model's hidden states the drafter reads beside the last (0: the input
                embeddings, i: the output of decoder layer i - 1); default: its kind's (`Drafter.default_layers`;
                `eagle`: a low, a middle and a high one, 2, L // 2 and L - 3 of L layers, as EAGLE-3 reads them).
            feature_noise: for `eagle`: standard deviation of the Gaussian noise added to the base model's features
                in training (0: none), so that the drafter learns to read imperfect ones, as it must its own.
            feature_loss: the weight of a feature regression added to the loss (0: none): the smooth-L1 distance
                between the state each step projects (`eagle`: its normed output) and the base model's last hidden
                state that scores the same token (what the base's lm_head reads), as EAGLE trains its features.
            features: a folder of the base model's hidden states on disk (`mtp.training.features`): before training,
                every process writes its share of the examples that the folder lacks (the base model on its
                device, in the compute dtype; then freed), and training reads them there, with only the base's
                embeddings, final norm and lm_head in memory; later runs on the same data write nothing. None:
                the base model runs in every step.
            loss_chunk: positions whose logits the loss computes at once: each chunk's logits (K x loss_chunk x
                the vocabulary or draft vocabulary, float32) are dropped after its loss and computed again in the
                backward pass, so the loss's peak memory is one chunk's, whatever the batch.
            precision: the trainer's precision (train.py links `trainer.precision` here): the frozen base loads in
                its compute dtype, bfloat16 under `bf16-*` (half the memory), else float32; the drafter trains in
                float32.
        """
        super().__init__()
        if isinstance(lora, dict):  # from a checkpoint's hyperparameters
            lora = Lora(**lora)
        self.save_hyperparameters(ignore=["lora"])
        self.hparams["lora"] = None if lora is None else asdict(lora)  # plain values: checkpoints load weights_only
        self.lora = lora
        weights = loss_weights if loss_weights is not None else default_weights(num_heads, loss_decay)
        if len(weights) != num_heads:
            raise ValueError(f"loss_weights has {len(weights)} entries for {num_heads} heads: give one per head.")
        self.weights = weights
        if draft_vocab < 0:
            raise ValueError(f"draft_vocab={draft_vocab}: use 0 (the whole vocabulary) or a number of tokens.")
        if feature_loss < 0:
            raise ValueError(f"feature_loss={feature_loss}: give a weight >= 0 (0: no feature regression).")
        if loss_chunk < 1:
            raise ValueError(f"loss_chunk={loss_chunk}: give the positions a chunk of the loss holds, at least 1.")
        if lora is not None and features is not None:
            raise ValueError(
                "features with lora: the adapted base's hidden states change every step, so they cannot be read "
                "from disk; drop features (or drop lora to keep the base frozen)."
            )
        dtype = compute_dtype(precision)
        self.base_model, tokenizer = load_base(base_model, dtype=dtype, fast=False, layers=features is None)
        self.base_model.requires_grad_(False)
        identity = base_identity(base_model, self.base_model, tokenizer)
        self.identity = identity
        depth = self.base_model.config.get_text_config(decoder=True).num_hidden_layers
        if feature_layers is None:
            feature_layers = Drafter.of_kind(head_type).default_layers(depth)
        if feature_layers and not all(0 <= i <= depth for i in feature_layers):
            raise ValueError(
                f"feature_layers {feature_layers}: this base model has {depth} decoder layers; choose hidden states "
                f"0 (the input embeddings) to {depth} (the last layer's output)."
            )
        config = DrafterConfig(
            num_heads=num_heads, num_layers=num_layers, lm_head=lm_head, head_type=head_type,
            feature_layers=feature_layers or [], **identity,
        )  # fmt: skip
        self.heads = Drafter.kinds[config.head_type].new(config, self.base_model).float()  # float32 master weights
        if init_heads is not None:
            start = Drafter.from_pretrained(init_heads)
            start.check_base(base_model, self.base_model, tokenizer)
            kind = ("num_heads", "num_layers", "lm_head", "head_type")
            if any(getattr(start.config, key) != getattr(config, key) for key in kind):
                raise ValueError(
                    f"init_heads {init_heads!r} holds {', '.join(f'{k} {getattr(start.config, k)}' for k in kind)}; "
                    f"this model has {', '.join(f'{k} {getattr(config, k)}' for k in kind)}: set the same."
                )
            if start.config.draft_vocab is not None:
                self.heads.set_draft_vocab(start.config.draft_vocab, self.base_model)
            self.heads.load_state_dict(start.state_dict())
        if lora is not None:  # the adapter is only right on the weights it was trained on
            config.adapter, config.base_weights = True, weights_fingerprint(self.base_model)
            self.base_model = with_adapters(self.base_model, lora)
        self.features: Features | None = None  # opened in setup, when `features` names a folder
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
        # frozen: no dropout, whatever Lightning asks of the module; with adapters, theirs trains
        self.base_model.train(mode and self.lora is not None)
        return self

    def backbone(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The base model's hidden states at the drafter's `feature_layers`, then its last ones: (B, T, (L+1) H)."""
        return backbone(self.base_model, batch["input_ids"], batch["attention_mask"], self.heads.config.feature_layers)

    def hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """`backbone`'s states (B, T, (L+1) H): with `features`, those the loader read from disk into the batch;
        with adapters, with their gradients."""
        if self.lora is not None:
            return self.backbone(batch)
        if self.features is None:
            with torch.no_grad():
                return self.backbone(batch)
        if "features" not in batch:
            raise ValueError("model.features is set, but the batches carry no hidden states: train with "
                             "DrafterDataModule, which reads them from the folder.")  # fmt: skip
        return batch["features"].to(self.base_model.dtype)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        states = self.hidden_states(batch)  # (B, T, (L+1) H)
        size = self.heads.config.hidden_size
        hidden, features = states[..., -size:], states[..., :-size]  # (B, T, H) the last, (B, T, L H) the layers'
        if self.hparams.feature_noise and stage == "train":
            features = features + self.hparams.feature_noise * torch.randn_like(features)
        targets = head_targets(batch["input_ids"], batch["loss_mask"], len(self.weights))  # (K, B, T)
        keep = (targets != IGNORE).any(0)  # (B, T): positions where some head has a target
        targets = targets[:, keep]  # (K, N)
        lm_head, num_heads = self.base_model.get_output_embeddings(), len(self.weights)
        embed = self.base_model.get_input_embeddings()
        outputs = self.heads.teacher_forced(hidden, features, batch["input_ids"], keep, embed)  # (K, N, H)
        draft = self.heads.config.draft_vocab
        scored = targets if draft is None else draft_columns(targets, draft, self.heads.config.vocab_size)  # (K, N)
        # (K, N, H) the base model's last hidden state at t+k+1, which scores token t+k+2; a target, not a path for
        # gradients into the adapters
        before = None
        if self.hparams.teacher or self.hparams.feature_loss:
            before = torch.stack([shifted(hidden.detach(), k + 1)[keep] for k in range(num_heads)])
        rows = None  # head k's target with a teacher: the base model's own prediction at t+k+1, for token t+k+2
        if self.hparams.teacher:
            rows = lm_head.weight if draft is None else lm_head.weight[torch.tensor(draft, device=hidden.device)]
        chunk, count = self.hparams.loss_chunk, targets.shape[1]
        score = partial(self._scored, lm_head, rows)
        if count > chunk:  # each chunk's logits recomputed in the backward pass instead of kept
            score = partial(checkpoint, score, use_reentrant=False)
        pieces = [slice(start, start + chunk) for start in range(0, max(count, 1), chunk)]
        found = [score(outputs[:, at], None if rows is None else before[:, at], targets[:, at], scored[:, at])
                 for at in pieces]  # fmt: skip  # per chunk: summed losses (K,), hits (K, n, RANKS)
        loss, per_head = weighted(sum(sums for sums, _ in found), targets if rows is not None else scored, self.weights)
        hits = torch.cat([chunk_hits for _, chunk_hits in found], 1)  # (K, N, RANKS)
        batch_size = batch["input_ids"].shape[0]
        if self.hparams.feature_loss:
            regression = feature_regression(outputs, before, targets, self.weights)
            loss = loss + self.hparams.feature_loss * regression
            self.log(f"{stage}/feature_loss", regression, batch_size=batch_size, sync_dist=stage == "val")
        lora = self.lora
        if lora is not None:
            drift, agreement = self.drift(batch, hidden)
            ramp = min((self.global_step + 1) / lora.heads_warmup_steps, 1.0) if lora.heads_warmup_steps else 1.0
            loss = (ramp if stage == "train" else 1.0) * loss + lora.distill_weight * drift
            self.log(f"{stage}/kl", drift, batch_size=batch_size, sync_dist=stage == "val")
            self.log(f"{stage}/agreement", agreement, prog_bar=stage == "val", batch_size=batch_size,
                     sync_dist=stage == "val")  # fmt: skip
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=batch_size, sync_dist=stage == "val")
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

    def _scored(self, lm_head: nn.Module, rows: torch.Tensor | None, states: torch.Tensor, before: torch.Tensor | None,
                targets: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The loss of the drafter's states (K, n, H) at n positions: each head's summed loss (K,), and hits (K, n,
        RANKS), head k's rank-r guess at position n is the target. With `rows` (the lm_head's rows of the
        vocabulary the drafter ranks), the teacher's distribution from the base's hidden states `before` (K, n, H)
        is the target; else the tokens: `targets` (K, n), or their draft-vocabulary columns `scored`."""
        logits = self.heads.project(states, lm_head)  # (K, n, V), or (K, n, D): the draft tokens alone, as decoding
        teacher = None if rows is None else before @ rows.T  # (K, n, V or D)
        sums = summed_cross_entropy(logits, targets if teacher is not None else scored, teacher)
        # (MulticlassAccuracy over a 49k-class vocabulary is orders of magnitude slower than this); a target outside
        # the draft vocabulary is scored IGNORE, matches no column and counts as a miss
        hits = logits.detach().topk(RANKS, dim=-1).indices == scored.unsqueeze(-1)  # (K, n, RANKS)
        return sums, hits

    def drift(self, batch: dict[str, torch.Tensor], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KL(original || adapted) of the next-token distributions, and the share of positions where their top-1
        agree, over the positions that predict an answer token; the original is the network with its adapters off."""
        at = F.pad(batch["loss_mask"][:, 1:], (0, 1))  # (B, T): position t predicts answer token t+1
        lm_head = self.base_model.get_output_embeddings()
        with torch.no_grad(), self.base_model.disable_adapter():
            original = lm_head(self.backbone(batch)[at]).log_softmax(-1)  # (N, V)
        kl, agree = divergence(lm_head(hidden[at]).log_softmax(-1), original)
        return kl / len(original), agree / len(original)

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def setup(self, stage: str) -> None:
        """Write the hidden states the `features` folder lacks, every process its share; choose the draft vocabulary
        before the optimizer is made: a drafter's own lm_head is sized by it."""
        if self.hparams.features is not None:
            data, trainer = self.trainer.datamodule, self.trainer
            examples = [ids for ids, _ in [*data.train_examples, *data.val_examples]]
            wanted = manifest(self.identity, self.heads.config.feature_layers)
            write_features(self.hparams.features, self.hparams.base_model, wanted, examples, trainer.global_rank,
                           trainer.world_size, trainer.strategy.root_device, compute_dtype(self.hparams.precision),
                           data.batch_size)  # fmt: skip
            trainer.strategy.barrier("features written")
            self.features = Features(self.hparams.features, wanted)
            data.read_features(self.features)  # the batches carry the states, read ahead by the loader's worker
        if stage == "fit" and self.hparams.draft_vocab and self.hparams.init_heads is None:
            examples = self.trainer.datamodule.train_examples
            targets = torch.cat([ids[mask] for ids, mask in examples])  # every target token of the training split
            counts = torch.bincount(targets, minlength=self.heads.config.vocab_size)  # (V,)
            top = counts.topk(min(self.hparams.draft_vocab, len(counts)))
            self.heads.set_draft_vocab(top.indices.tolist(), self.base_model)
            rank_zero_info(
                f"Draft vocabulary: the {len(top.indices)} most frequent tokens cover "
                f"{float(top.values.sum() / counts.sum()):.1%} of the training targets"
            )

    def on_train_start(self) -> None:
        data = self.trainer.datamodule
        if data is not None:  # the configured batch (loaders passed alone say nothing of it)
            found = estimate(self, data.batch_size, data.max_length)
            rank_zero_info(memory_line(found, data.batch_size, data.max_length))

    def on_validation_epoch_start(self) -> None:
        self.rank_accuracy.reset()

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:  # the last validation run calibrates the saved heads
            self.heads.config.calibration = [
                [round(a, 5) for a in head] for head in self.rank_accuracy.compute().tolist()
            ]

    def configure_optimizers(self):
        lr, lora = self.hparams.lr, self.lora
        groups = [{"params": list(self.heads.parameters()), "lr": lr * (lora.heads_lr_scale if lora else 1.0)}]
        if lora is not None:
            groups.append({"params": [p for p in self.base_model.parameters() if p.requires_grad], "lr": lr})
        optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=self.hparams.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = min(self.hparams.warmup_steps, total - 1)

        def scale(step: int) -> float:  # linear warmup, then cosine decay to 0 at the last step
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / max(total - warmup, 1)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def state_dict(self, *args, **kwargs):
        """Heads, adapters (with lora) and metric state: the base's own weights are reloaded from base_model, never
        checkpointed."""
        state = super().state_dict(*args, **kwargs)
        return {key: value for key, value in state.items() if not key.startswith("base_model.") or "lora_" in key}

    def on_fit_end(self) -> None:
        if self.trainer.fast_dev_run:  # a smoke run: like Lightning's logs and checkpoints, nothing is written
            return
        folder = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "heads"  # log_dir: a collective call
        if self.trainer.is_global_zero:
            self.heads.save_pretrained(folder)
            if self.lora is not None:  # peft's own files beside the heads: adapter_config.json, ...
                self.base_model.save_pretrained(folder)
            metrics = self.trainer.callback_metrics
            rank_zero_info(f"Heads saved to {folder}")
            for k in range(len(self.weights)):
                found = [
                    f"top-{top} {metrics[f'val/head{k}_top{top}']:.3f}"
                    for top in TOP_K
                    if f"val/head{k}_top{top}" in metrics
                ]
                rank_zero_info(f"head {k} (token t+{k + 2}) validation accuracy: {', '.join(found) or 'not measured'}")
