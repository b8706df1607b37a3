"""LightningModule: a frozen base model plus a trainable drafter, the multi-head loss and per-head accuracy."""

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
    draft_columns,
    feature_regression,
    head_targets,
    shifted,
    summed_cross_entropy,
    weighted,
)
from mtp.training.memory import estimate, memory_line
from mtp.training.settings import DrafterSettings, Loss, Optim

TOP_K = (1, 5)
# Lightning warns about modules in eval mode when training starts: the frozen base is, on purpose.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode")


def build_drafter(model: nn.Module, tokenizer, identity: dict, drafting: DrafterSettings) -> Drafter:
    """The drafter `drafting` asks for, over `model` (`identity`: `base_identity`'s fields, the name it was loaded
    from among them), in float32 (the master weights under mixed precision); started from the drafter in
    `drafting.init` where it names one."""
    depth = model.config.get_text_config(decoder=True).num_hidden_layers
    layers = drafting.feature_layers
    if layers is None:
        layers = Drafter.of_kind(drafting.head_type).default_layers(depth)
    if layers and not all(0 <= i <= depth for i in layers):
        raise ValueError(
            f"feature_layers {layers}: this base model has {depth} decoder layers; choose hidden states "
            f"0 (the input embeddings) to {depth} (the last layer's output)."
        )
    config = DrafterConfig(
        num_heads=drafting.num_heads,
        num_layers=drafting.num_layers,
        lm_head=drafting.lm_head,
        head_type=drafting.head_type,
        feature_layers=layers or [],
        **identity,
    )
    drafter = Drafter.kinds[config.head_type].new(config, model).float()
    if drafting.init is not None:
        start = Drafter.from_pretrained(drafting.init)
        start.check_base(identity["base_model"], model, tokenizer)
        kind = ("num_heads", "num_layers", "lm_head", "head_type")
        if any(getattr(start.config, key) != getattr(config, key) for key in kind):
            raise ValueError(
                f"drafter.init {drafting.init!r} holds "
                f"{', '.join(f'{k} {getattr(start.config, k)}' for k in kind)}; "
                f"this model has {', '.join(f'{k} {getattr(config, k)}' for k in kind)}: set the same."
            )
        if start.config.draft_vocab is not None:
            drafter.set_draft_vocab(start.config.draft_vocab, model)
        drafter.load_state_dict(start.state_dict())
    return drafter


class DrafterModule(L.LightningModule):
    def __init__(
        self,
        base_model: str = DEFAULT_BASE,
        drafter: DrafterSettings = DrafterSettings(),
        loss: Loss = Loss(),
        optim: Optim = Optim(),
        lora: Lora | None = None,
        features: str | None = None,
        precision: str = "32-true",
    ):
        """A drafter trained by teacher forcing on a frozen base model (or, with `lora`, on the base model trained
        through low-rank adapters at the same time).

        Args:
            base_model: the base model (see `mtp.base.load_base`): packaged default, folder, .gguf, .json, hub id.
            drafter: the drafter to build (`mtp.training.settings.DrafterSettings`: its kind, heads, layers, lm_head,
                features read, draft vocabulary, a folder to start from).
            loss: what it learns and how the heads' losses add up (`mtp.training.settings.Loss`).
            optim: AdamW's peak learning rate, weight decay and warmup (`mtp.training.settings.Optim`).
            lora: train LoRA adapters of the base model with the drafter (see `Lora`); None: the base stays frozen.
            features: a folder of the base model's hidden states on disk (`mtp.training.features`): before training,
                every process writes its share of the examples that the folder lacks (the base model on its
                device, in the compute dtype; then freed), and training reads them there, with only the base's
                embeddings, final norm and lm_head in memory; later runs on the same data write nothing. None:
                the base model runs in every step.
            precision: the trainer's precision (train.py links `trainer.precision` here): the frozen base loads in
                its compute dtype, bfloat16 under `bf16-*` (half the memory), else float32; the drafter trains in
                float32.
        """
        super().__init__()
        # from a checkpoint's hyperparameters, where they are plain values (so that checkpoints load weights_only)
        drafter, loss, optim = (
            kind(**value) if isinstance(value, dict) else value
            for kind, value in ((DrafterSettings, drafter), (Loss, loss), (Optim, optim))
        )
        lora = Lora(**lora) if isinstance(lora, dict) else lora
        self.save_hyperparameters(ignore=["drafter", "loss", "optim", "lora"])
        for name, value in (("drafter", drafter), ("loss", loss), ("optim", optim), ("lora", lora)):
            self.hparams[name] = None if value is None else asdict(value)
        if lora is not None and features is not None:
            raise ValueError(
                "features with lora: the adapted base's hidden states change every step, so they cannot be read "
                "from disk; drop features (or drop lora to keep the base frozen)."
            )
        self.drafting, self.loss, self.optim, self.lora = drafter, loss, optim, lora
        self.weights = loss.head_weights(drafter.num_heads)
        self.base_model, tokenizer = load_base(
            base_model, dtype=compute_dtype(precision), fast=False, layers=features is None
        )
        self.base_model.requires_grad_(False)
        self.identity = base_identity(base_model, self.base_model, tokenizer)
        self.drafter = build_drafter(self.base_model, tokenizer, self.identity, drafter)
        if lora is not None:  # the adapter is only right on the weights it was trained on
            self.drafter.config.adapter, self.drafter.config.base_weights = True, weights_fingerprint(self.base_model)
            self.base_model = with_adapters(self.base_model, lora)
        self.features: Features | None = None  # opened in setup, when `features` names a folder
        self.strict_loading = False  # checkpoints hold the drafter only; the base comes from base_model
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_head{k}_top{top}": MeanMetric()
                for stage in ("train", "val")
                for k in range(drafter.num_heads)
                for top in TOP_K
            }
        )
        self.rank_accuracy = RankAccuracy(drafter.num_heads)  # over each validation run; saved with the drafter

    def train(self, mode: bool = True):
        super().train(mode)
        # frozen: no dropout, whatever Lightning asks of the module; with adapters, theirs trains
        self.base_model.train(mode and self.lora is not None)
        return self

    def backbone(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The base model's hidden states at the drafter's `feature_layers`, then its last ones: (B, T, (L+1) H)."""
        return backbone(
            self.base_model, batch["input_ids"], batch["attention_mask"], self.drafter.config.feature_layers
        )

    def hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """`backbone`'s states (B, T, (L+1) H): with `features`, those the loader read from disk into the batch;
        with adapters, with their gradients."""
        if self.lora is not None:
            return self.backbone(batch)
        if self.features is None:
            with torch.no_grad():
                return self.backbone(batch)
        if "features" not in batch:
            raise ValueError(
                "model.features is set, but the batches carry no hidden states: train with "
                "DrafterDataModule, which reads them from the folder."
            )
        return batch["features"].to(self.base_model.dtype)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        states = self.hidden_states(batch)  # (B, T, (L+1) H)
        size = self.drafter.config.hidden_size
        hidden, features = states[..., -size:], states[..., :-size]  # (B, T, H) the last, (B, T, L H) the layers'
        if self.loss.feature_noise and stage == "train":
            features = features + self.loss.feature_noise * torch.randn_like(features)
        targets = head_targets(batch["input_ids"], batch["loss_mask"], len(self.weights))  # (K, B, T)
        keep = (targets != IGNORE).any(0)  # (B, T): positions where some head has a target
        targets = targets[:, keep]  # (K, N)
        embed = self.base_model.get_input_embeddings()
        outputs = self.drafter.teacher_forced(hidden, features, batch["input_ids"], keep, embed)  # (K, N, H)
        # (K, N, H) the base model's last hidden state at t+k+1, which scores token t+k+2; a target, not a path for
        # gradients into the adapters
        before = None
        if self.loss.teacher or self.loss.feature_loss:
            before = torch.stack([shifted(hidden.detach(), k + 1)[keep] for k in range(len(self.weights))])
        loss, per_head, hits = self.heads_loss(outputs, before, targets)
        log = partial(self.log, batch_size=batch["input_ids"].shape[0], sync_dist=stage == "val")
        if self.loss.feature_loss:
            regression = feature_regression(outputs, before, targets, self.weights)
            loss = loss + self.loss.feature_loss * regression
            log(f"{stage}/feature_loss", regression)
        if self.lora is not None:
            drift, agreement = self.drift(batch, hidden)
            warmup = self.lora.heads_warmup_steps
            ramp = min((self.global_step + 1) / warmup, 1.0) if warmup and stage == "train" else 1.0
            loss = ramp * loss + self.lora.distill_weight * drift
            log(f"{stage}/kl", drift)
            log(f"{stage}/agreement", agreement, prog_bar=stage == "val")
        log(f"{stage}/loss", loss, prog_bar=True)
        if stage == "val":
            self.rank_accuracy.update(hits, targets != IGNORE)
        for k in range(len(self.weights)):
            log(f"{stage}/head{k}_loss", per_head[k])
            valid = targets[k] != IGNORE  # (N,)
            for top in TOP_K:
                metric = self.metrics[f"{stage}_head{k}_top{top}"]
                metric(hits[k, valid, :top].any(-1).float())  # forward: this batch's value, and accumulate
                log(f"{stage}/head{k}_top{top}", metric, prog_bar=top == 1 and stage == "val", sync_dist=False)
        return loss

    def heads_loss(
        self, outputs: torch.Tensor, before: torch.Tensor | None, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weighted loss of the drafter's states `outputs` (K, N, H) for `targets` (K, N) (with a teacher: the
        base's distribution from its states `before` (K, N, H)), each head's loss (K,), and its hits (K, N, RANKS),
        over chunks of positions whose logits are computed again in the backward pass rather than kept."""
        lm_head, draft = self.base_model.get_output_embeddings(), self.drafter.config.draft_vocab
        scored = targets if draft is None else draft_columns(targets, draft, self.drafter.config.vocab_size)  # (K, N)
        rows = None  # head k's target with a teacher: the base model's own prediction at t+k+1, for token t+k+2
        if self.loss.teacher:
            rows = lm_head.weight if draft is None else lm_head.weight[torch.tensor(draft, device=targets.device)]
        chunk, count = self.loss.chunk, targets.shape[1]
        score = partial(self._scored, lm_head, rows)
        if count > chunk:  # each chunk's logits recomputed in the backward pass instead of kept
            score = partial(checkpoint, score, use_reentrant=False)
        pieces = [slice(start, start + chunk) for start in range(0, max(count, 1), chunk)]
        found = [
            score(outputs[:, at], None if rows is None else before[:, at], targets[:, at], scored[:, at])
            for at in pieces
        ]  # per chunk: summed losses (K,), hits (K, n, RANKS)
        loss, per_head = weighted(sum(sums for sums, _ in found), targets if rows is not None else scored, self.weights)
        return loss, per_head, torch.cat([chunk_hits for _, chunk_hits in found], 1)

    def _scored(
        self,
        lm_head: nn.Module,
        rows: torch.Tensor | None,
        states: torch.Tensor,
        before: torch.Tensor | None,
        targets: torch.Tensor,
        scored: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of the drafter's states (K, n, H) at n positions: each head's summed loss (K,), and hits (K, n,
        RANKS), head k's rank-r guess at position n is the target. With `rows` (the lm_head's rows of the
        vocabulary the drafter ranks), the teacher's distribution from the base's hidden states `before` (K, n, H)
        is the target; else the tokens: `targets` (K, n), or their draft-vocabulary columns `scored`."""
        logits = self.drafter.project(states, lm_head)  # (K, n, V), or (K, n, D): the draft tokens alone, as decoding
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
            wanted = manifest(self.identity, self.drafter.config.feature_layers)
            write_features(
                self.hparams.features,
                self.hparams.base_model,
                wanted,
                examples,
                trainer.global_rank,
                trainer.world_size,
                trainer.strategy.root_device,
                compute_dtype(self.hparams.precision),
                data.batch_size,
            )
            trainer.strategy.barrier("features written")
            self.features = Features(self.hparams.features, wanted)
            data.read_features(self.features)  # the batches carry the states, read ahead by the loader's worker
        if stage == "fit" and self.drafting.draft_vocab and self.drafting.init is None:
            examples = self.trainer.datamodule.train_examples
            targets = torch.cat([ids[mask] for ids, mask in examples])  # every target token of the training split
            counts = torch.bincount(targets, minlength=self.drafter.config.vocab_size)  # (V,)
            top = counts.topk(min(self.drafting.draft_vocab, len(counts)))
            self.drafter.set_draft_vocab(top.indices.tolist(), self.base_model)
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
            self.drafter.config.calibration = [
                [round(a, 5) for a in head] for head in self.rank_accuracy.compute().tolist()
            ]

    def configure_optimizers(self):
        lr, lora = self.optim.lr, self.lora
        groups = [{"params": list(self.drafter.parameters()), "lr": lr * (lora.heads_lr_scale if lora else 1.0)}]
        if lora is not None:
            groups.append({"params": [p for p in self.base_model.parameters() if p.requires_grad], "lr": lr})
        optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=self.optim.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = min(self.optim.warmup_steps, total - 1)

        def scale(step: int) -> float:  # linear warmup, then cosine decay to 0 at the last step
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / max(total - warmup, 1)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Checkpoints written before the drafter was `drafter` held it as `heads`: renamed as they load."""
        state = checkpoint["state_dict"]
        for key in [key for key in state if key.startswith("heads.")]:
            state["drafter." + key.removeprefix("heads.")] = state.pop(key)

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
            self.drafter.save_pretrained(folder)
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
