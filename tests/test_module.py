import copy
import json
import random
from dataclasses import replace
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors.torch import load_file
from torch.nn import functional as F

from mtp.base import load_tokenizer
from mtp.drafters.heads import MedusaHeads
from mtp.training.data import DrafterDataModule, collate, encode
from mtp.training.module import DrafterModule
from mtp.training.rows import read_rows, to_example
from mtp.training.settings import DrafterSettings, Loss, Optim
from tests.conftest import TINY_BASE, TINY_CHAT, head_logits, trainer


def test_training_leaves_the_base_untouched_and_optimises_only_the_heads(tmp_path):
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=3, lm_head="own"), optim=Optim(lr=1e-2))
    base_before = {name: tensor.clone() for name, tensor in module.base_model.state_dict().items()}
    heads_before = {name: tensor.clone() for name, tensor in module.drafter.state_dict().items()}
    fit = trainer(tmp_path, max_steps=5, limit_val_batches=0)
    fit.fit(module, DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4))

    for name, tensor in module.base_model.state_dict().items():
        assert torch.equal(tensor, base_before[name]), name
    assert all(not p.requires_grad and p.grad is None for p in module.base_model.parameters())
    assert not module.base_model.training
    assert any(not torch.equal(t, heads_before[n]) for n, t in module.drafter.state_dict().items())  # heads moved
    optimised = {id(p) for group in fit.optimizers[0].param_groups for p in group["params"]}
    assert optimised == {id(p) for p in module.drafter.parameters()}

    checkpoint = torch.load(next((tmp_path / "checkpoints").glob("*.ckpt")), weights_only=True)
    assert checkpoint["state_dict"] and all(key.startswith("drafter.") for key in checkpoint["state_dict"])
    # a checkpoint written when the drafter was `heads` resumes into `drafter`
    state = checkpoint["state_dict"]
    checkpoint["state_dict"] = {key.replace("drafter.", "heads.", 1): value for key, value in state.items()}
    torch.save(checkpoint, tmp_path / "before.ckpt")
    resumed = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=3, lm_head="own"))
    trainer(tmp_path / "again", max_steps=5, limit_val_batches=0).fit(
        resumed, DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4), ckpt_path=tmp_path / "before.ckpt"
    )
    assert all(torch.equal(resumed.drafter.state_dict()[n], t) for n, t in module.drafter.state_dict().items())
    exported = tmp_path / "heads"
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    assert set(load_file(exported / "model.safetensors")) == {f"{k}" for k in module.drafter.state_dict()}
    loaded = MedusaHeads.from_pretrained(exported)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in module.drafter.state_dict().items())


def cycle_rows(path, rows=40, length=24, seed=0):
    """Plain text where every word is one token and is always followed by the same next word: tokens
    t+2, t+3, ... follow from token t."""
    tokenizer = load_tokenizer(TINY_BASE)
    words = sorted(w[1:] for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3)
    rng = random.Random(seed)
    rng.shuffle(words)
    words = words[:16]
    assert len(tokenizer(" " + " ".join(words)).input_ids) == 16  # one token per word
    with open(path, "w") as file:
        for _ in range(rows):
            start = rng.randrange(16)
            file.write(json.dumps({"text": "".join(" " + words[(start + i) % 16] for i in range(length))}) + "\n")
    return str(path)


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_heads_learn_a_predictable_future_far_above_chance(tmp_path, lm_head):
    data = DrafterDataModule(cycle_rows(tmp_path / "cycle.jsonl"), TINY_BASE, batch_size=8, val_fraction=0.125)
    module = DrafterModule(
        TINY_BASE, drafter=DrafterSettings(num_heads=3, lm_head=lm_head), optim=Optim(lr=3e-3, warmup_steps=10)
    )
    fit = trainer(tmp_path, max_steps=120, check_val_every_n_epoch=None, val_check_interval=120)
    fit.fit(module, data)
    calibration = module.drafter.config.calibration  # rank accuracies of the last validation run, saved with heads
    for k in range(3):  # one of 16 words follows: chance is 1/16
        assert fit.callback_metrics[f"val/head{k}_top1"] > 0.75, (k, fit.callback_metrics)
        assert len(calibration[k]) == 10 and calibration[k][0] == pytest.approx(
            float(fit.callback_metrics[f"val/head{k}_top1"]), abs=1e-4
        )
        assert sum(calibration[k][:5]) == pytest.approx(float(fit.callback_metrics[f"val/head{k}_top5"]), abs=1e-4)


class Crash(Callback):
    def __init__(self, step: int = 5):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


class FirstStep(Callback):
    first = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.first = trainer.global_step if self.first is None else self.first


class Restored(Callback):
    """The heads' weights, optimizer state and schedule as training starts: after a checkpoint is restored."""

    def on_train_start(self, trainer, module):
        self.heads = {name: tensor.clone() for name, tensor in module.drafter.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.schedule = trainer.lr_scheduler_configs[0].scheduler.state_dict()


def test_a_run_stopped_midway_resumes_at_the_step_it_reached_with_its_heads_and_optimizer(tmp_path):
    data = DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4)
    every_2 = dict(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer(tmp_path, 8, [ModelCheckpoint(**every_2), Crash()], limit_val_batches=0).fit(
            DrafterModule(TINY_BASE), data
        )
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    saved = checkpoint["state_dict"]

    module, first, restored = DrafterModule(TINY_BASE), FirstStep(), Restored()
    fresh = {name: tensor.clone() for name, tensor in module.drafter.state_dict().items()}
    resumed = trainer(tmp_path, 8, [ModelCheckpoint(**every_2), first, restored], limit_val_batches=0)
    resumed.fit(
        module, DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert first.first == 4 and resumed.global_step == 8
    # Not only the step counter: the heads restart from the saved weights (strict_loading=False would hide a key
    # mismatch), which are not the fresh ones, and AdamW from its saved moments, step count and learning rate.
    heads = {key.removeprefix("drafter."): value for key, value in saved.items() if key.startswith("drafter.")}
    assert heads.keys() == restored.heads.keys() == fresh.keys()
    assert all(torch.equal(restored.heads[name], tensor) for name, tensor in heads.items())
    assert not all(torch.equal(fresh[name], tensor) for name, tensor in heads.items())
    optimizer = checkpoint["optimizer_states"][0]
    assert optimizer["state"] and restored.optimizer["state"].keys() == optimizer["state"].keys()
    for index, state in optimizer["state"].items():  # exp_avg, exp_avg_sq, step of each parameter
        assert all(torch.equal(restored.optimizer["state"][index][key], value) for key, value in state.items())
    assert restored.optimizer["param_groups"] == optimizer["param_groups"]
    assert restored.schedule == checkpoint["lr_schedulers"][0] and restored.schedule["last_epoch"] == 4
    assert not all(torch.equal(module.state_dict()[key], value) for key, value in saved.items())  # it trained on


class Seen(Callback):
    """The epoch and token ids of every batch trained on."""

    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch["input_ids"].tolist()))


@pytest.mark.parametrize(
    "crash, saved",
    [(20, {"every_n_train_steps": 2}), (16, {"every_n_train_steps": 2}), (22, {})],
    ids=["mid-epoch", "at-the-epoch-end", "at-a-validation"],  # {}: after each validation, every 4 batches
)
def test_a_resumed_run_trains_on_the_batches_and_reaches_the_weights_of_a_run_never_stopped(tmp_path, crash, saved):
    """16 batches an epoch; stopped 4 batches into the second epoch, at the end of the first, or 6 batches into the
    second with the last checkpoint taken at a validation 2 batches earlier. The order of each epoch is fixed by the
    seed and the epoch; the resumed run trains on the rest of the epoch it was in, in order, then on the next."""
    data = partial(DrafterDataModule, TINY_CHAT, TINY_BASE, batch_size=4)
    fit = partial(trainer, tmp_path, 28, val_check_interval=4, limit_val_batches=1)
    L.seed_everything(0)
    whole, never_stopped = Seen(), DrafterModule(TINY_BASE, optim=Optim(lr=1e-2))
    fit([whole], enable_checkpointing=False).fit(never_stopped, data())
    L.seed_everything(0)
    stopped = Seen()
    with pytest.raises(RuntimeError, match="simulated crash"):
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, **saved)
        fit([checkpoints, stopped, Crash(crash)]).fit(DrafterModule(TINY_BASE, optim=Optim(lr=1e-2)), data())
    resumed, module = Seen(), DrafterModule(TINY_BASE, optim=Optim(lr=1e-2))
    fit([resumed], enable_checkpointing=False).fit(module, data(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    epochs = [[ids for epoch, ids in whole.batches if epoch == e] for e in (0, 1)]
    assert len(epochs[0]) == 16 and len({str(ids) for ids in epochs[0]}) == 16 and epochs[1] != epochs[0][:12]
    last = crash - 2 if not saved else crash  # the step of the last checkpoint
    assert stopped.batches[:last] + resumed.batches == whole.batches
    for name, weight in never_stopped.drafter.state_dict().items():
        torch.testing.assert_close(module.drafter.state_dict()[name], weight, rtol=0, atol=1e-6, msg=name)


def test_a_checkpoint_taken_mid_epoch_on_two_processes_does_not_resume_on_one():
    data = DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4)
    data.setup("fit")
    data.load_state_dict({"epoch": 1, "batches": 4, "processes": 2})
    with pytest.raises(ValueError, match="4 batches into epoch 1 on 2 processes; this run has 1: resume it on as many"):
        data.train_dataloader()
    data.load_state_dict({"epoch": 1, "batches": 0, "processes": 2})  # at an epoch's start: any number
    assert len(data.train_dataloader()) == 16


def test_loss_weights_must_match_the_number_of_heads():
    with pytest.raises(ValueError, match="loss weights has 2 entries for 4 heads"):
        DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=4), loss=Loss(weights=[1.0, 0.5]))


def hand_loss(module: DrafterModule, examples, weights: list[float], draft: list[int] | None = None) -> torch.Tensor:
    """The module's loss computed by hand, one unpadded example at a time: head k at position t against token
    t+k+2, wherever that token is in the example's loss mask; per head the mean over the batch, then weighted.
    With a draft vocabulary, the softmax runs over its tokens only and a target outside it is left out."""
    sums, counts = [0.0] * len(weights), [0] * len(weights)
    for ids, mask in examples:
        hidden = module.base_model.get_decoder()(input_ids=ids[None]).last_hidden_state[0]  # (T, H)
        logits = module.drafter(hidden, module.base_model.get_output_embeddings())  # (K, T, V)
        for k in range(len(weights)):
            for t in range(len(ids) - k - 2):
                target = int(ids[t + k + 2])
                if not mask[t + k + 2] or (draft is not None and target not in draft):
                    continue
                if draft is None:
                    sums[k] += F.cross_entropy(logits[k, t], ids[t + k + 2])
                else:
                    sums[k] += F.cross_entropy(logits[k, t, draft], torch.tensor(draft.index(target)))
                counts[k] += 1
    return sum(weight * total / count for weight, total, count in zip(weights, sums, counts, strict=True))


@torch.no_grad()
def test_the_training_loss_is_the_hand_computed_one_on_assistant_tokens_at_t_plus_k_plus_2():
    """The module's real training step on chat rows pins: only loss-mask (assistant) tokens are targets, not
    every attended token; head k at position t is scored against token t+k+2; explicit loss weights weight each
    head's loss as given."""
    weights = [1.0, 0.5, 2.0]  # neither the default decay nor decreasing
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=3, lm_head="own"), loss=Loss(weights=weights))
    torch.manual_seed(0)
    for parameter in module.drafter.parameters():  # heads that differ from each other and from the base lm_head
        torch.nn.init.normal_(parameter, std=0.3)
    tokenizer = load_tokenizer(TINY_BASE)
    examples = [encode(tokenizer, to_example(row), 512) for row in read_rows(TINY_CHAT)[:3]]
    assert not any(mask.all() for _, mask in examples)  # user tokens: attended, never targets
    torch.testing.assert_close(module.training_step(collate(examples), 0), hand_loss(module, examples, weights))


@torch.no_grad()
@pytest.mark.parametrize("head_type, teacher", [("hydra", False), ("medusa", True), ("hydra", True)])
def test_hydra_heads_read_the_true_tokens_after_t_and_the_teacher_is_the_base_models_prediction(head_type, teacher):
    """By hand, one position at a time: a Hydra head k at t reads the input embeddings of tokens t+1 .. t+k+1;
    with `teacher`, head k learns the base model's own distribution at t+k+1 (its prediction of token t+k+2)."""
    weights = [1.0, 0.5]
    drafting = DrafterSettings(head_type, num_heads=2, lm_head="own")
    module = DrafterModule(TINY_BASE, drafting, Loss(weights=weights, teacher=teacher))
    torch.manual_seed(0)
    for parameter in module.drafter.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    tokenizer = load_tokenizer(TINY_BASE)
    examples = [encode(tokenizer, to_example(row), 512) for row in read_rows(TINY_CHAT)[:3]]
    lm_head, embed = module.base_model.get_output_embeddings(), module.base_model.get_input_embeddings()
    sums, counts = [0.0, 0.0], [0, 0]
    for ids, mask in examples:
        hidden = module.base_model.get_decoder()(input_ids=ids[None]).last_hidden_state[0]  # (T, H)
        for k in range(2):
            for t in range(len(ids) - k - 2):
                if mask[t + k + 2]:
                    following = embed(ids[t + 1 : t + k + 2])[None]  # (1, k+1, H): tokens t+1 .. t+k+1
                    logits = head_logits(module.drafter, k, hidden[t][None], lm_head, following)[0]  # (V,)
                    target = lm_head(hidden[t + k + 1]).softmax(-1) if teacher else ids[t + k + 2]
                    sums[k] += F.cross_entropy(logits, target)
                    counts[k] += 1
    expected = sum(weight * total / count for weight, total, count in zip(weights, sums, counts, strict=True))
    torch.testing.assert_close(module.training_step(collate(examples), 0), expected)


@torch.no_grad()
@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_with_a_draft_vocabulary_the_loss_ranks_its_tokens_only_and_a_target_outside_it_is_a_miss(lm_head):
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=2, lm_head=lm_head))
    torch.manual_seed(0)
    for parameter in module.drafter.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    tokenizer = load_tokenizer(TINY_BASE)
    examples = [encode(tokenizer, to_example(row), 512) for row in read_rows(TINY_CHAT)[:3]]
    targets = sorted({int(token) for ids, mask in examples for token in ids[mask]})
    draft = targets[::2] + [module.drafter.config.vocab_size - 1]  # half the targets, and a token that is none
    module.drafter.config.draft_vocab = draft
    expected = hand_loss(module, examples, [1.0, 0.8], draft)
    torch.testing.assert_close(module.training_step(collate(examples), 0), expected)

    module.validation_step(collate(examples), 0)
    hits = positions = 0  # head 0's top-1 accuracy by hand: a target outside the draft vocabulary is a miss
    for ids, mask in examples:
        hidden = module.base_model.get_decoder()(input_ids=ids[None]).last_hidden_state[0]  # (T, H)
        best = module.drafter(hidden, module.base_model.get_output_embeddings())[0][:, draft].argmax(-1)  # (T,)
        for t in range(len(ids) - 2):
            if mask[t + 2]:
                hits, positions = hits + (draft[best[t]] == ids[t + 2]), positions + 1
    assert module.rank_accuracy.compute()[0, 0] == pytest.approx(hits / positions)
    assert module.rank_accuracy.positions[0] == positions


class LearningRates(Callback):
    """The learning rate of each optimizer step."""

    def __init__(self):
        self.rates = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_the_learning_rate_warms_up_linearly_then_decays_along_a_cosine(tmp_path):
    rates = LearningRates()
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=1), optim=Optim(lr=1e-2, warmup_steps=3))
    data = DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=8)
    trainer(tmp_path, 10, [rates], limit_val_batches=0).fit(module, data)
    # steps 0-2: (step + 1) / 4 of the peak; steps 3-9: (1 + cos(pi * (step - 3) / 7)) / 2, cos(pi/7) = 0.90097,
    # cos(2 pi/7) = 0.62349, cos(3 pi/7) = 0.22252 (and cos(pi - x) = -cos(x))
    expected = [0.25, 0.5, 0.75, 1.0, 0.950484, 0.811745, 0.611260, 0.388740, 0.188255, 0.049516]
    assert rates.rates == pytest.approx([1e-2 * scale for scale in expected], abs=1e-8)


def test_the_draft_vocabulary_is_the_most_frequent_training_targets_and_is_saved(tmp_path):
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=2, draft_vocab=20))
    data = DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=8)
    trainer(tmp_path, 2, [], limit_val_batches=0).fit(module, data)
    targets = torch.cat([ids[mask] for ids, mask in data.train_examples])
    counts = torch.bincount(targets, minlength=module.drafter.config.vocab_size)
    draft = module.drafter.config.draft_vocab
    assert len(draft) == 20 == len(set(draft)) and counts[draft].min() >= counts.sort(descending=True).values[19]
    (saved,) = tmp_path.rglob("heads/config.json")
    assert json.loads(saved.read_text())["draft_vocab"] == draft
    with pytest.raises(ValueError, match="draft_vocab=-1"):
        DrafterModule(TINY_BASE, drafter=DrafterSettings(draft_vocab=-1))


@pytest.mark.parametrize(
    "drafter, objective",
    [
        (DrafterSettings(head_type="hydra", lm_head="own"), {"teacher": True}),
        (DrafterSettings(head_type="eagle"), {"feature_loss": 0.5}),
    ],
)
def test_the_loss_over_chunks_of_positions_and_its_gradients_equal_the_loss_over_all_at_once(drafter, objective):
    """`loss.chunk` bounds the loss's memory (a chunk's logits are recomputed in the backward pass): the loss, its
    gradients and the accuracies must not change, over the draft vocabulary too."""
    tokenizer = load_tokenizer(TINY_BASE)
    examples = [encode(tokenizer, to_example(row), 512) for row in read_rows(TINY_CHAT)[:4]]
    batch = collate(examples)
    found = []
    for chunk in (100_000, 7):  # one chunk; many (the batch has hundreds of positions)
        torch.manual_seed(0)
        module = DrafterModule(TINY_BASE, drafter=replace(drafter, num_heads=3), loss=Loss(chunk=chunk, **objective))
        for parameter in module.drafter.parameters():
            torch.nn.init.normal_(parameter, std=0.3)
        module.drafter.set_draft_vocab(list(range(0, module.drafter.config.vocab_size, 3)), module.base_model)
        loss = module.training_step(batch, 0)
        loss.backward()
        gradients = {name: p.grad.clone() for name, p in module.drafter.named_parameters() if p.grad is not None}
        accuracy = {name: float(metric.compute()) for name, metric in module.metrics.items() if metric.update_count}
        found.append((loss.detach(), gradients, accuracy))
    (loss, gradients, accuracy), (chunked, chunked_gradients, chunked_accuracy) = found
    assert batch["loss_mask"].sum() > 10 * 7 and len(gradients) >= 3
    torch.testing.assert_close(chunked, loss)
    assert chunked_gradients.keys() == gradients.keys() and chunked_accuracy == accuracy
    for name, gradient in gradients.items():
        torch.testing.assert_close(chunked_gradients[name], gradient, rtol=1e-4, atol=1e-6, msg=name)
