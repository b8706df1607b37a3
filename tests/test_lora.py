"""Medusa-2: LoRA adapters of the base model (peft) trained with the heads, saved beside them, merged to decode."""

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import mtp
from mtp.base import load_base
from mtp.drafters.contract import Drafter
from mtp.tools.drift import drift
from mtp.training.data import DrafterDataModule
from mtp.training.lora import Lora
from mtp.training.module import DrafterModule
from mtp.training.settings import DrafterSettings, Optim
from tests.conftest import TINY_BASE, TINY_CHAT, reference

LORA = Lora(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], heads_warmup_steps=2)


def fit(module, root, steps, ckpt_path=None, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=steps,
        default_root_dir=root,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        limit_val_batches=1,
        **kwargs,
    )
    trainer.fit(module, DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4, val_fraction=0.125), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A module trained 6 steps with adapters on q_proj and v_proj (checkpoints every 3), and its heads folder."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=2), optim=Optim(lr=3e-2), lora=LORA)
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=3, save_top_k=-1, save_last=True)
    fit(module, root, 6, callbacks=[checkpoints])
    return module, root


def base_weights(model) -> dict[str, torch.Tensor]:
    """The base's own weights, by their names in the unwrapped model."""
    return {
        name.replace(".base_layer", ""): tensor for name, tensor in model.state_dict().items() if "lora_" not in name
    }


def test_the_adapters_and_heads_train_while_the_bases_own_weights_stay_bit_identical(trained):
    module, _ = trained
    fresh, _ = load_base(TINY_BASE)
    adapted = base_weights(module.base_model.get_base_model())
    assert adapted.keys() == fresh.state_dict().keys()
    assert all(torch.equal(adapted[name], tensor) for name, tensor in fresh.state_dict().items())
    lora_b = [p for name, p in module.base_model.named_parameters() if "lora_B" in name]
    assert len(lora_b) == 2 * 2 and all(p.abs().sum() > 0 for p in lora_b)  # 2 layers x q, v; they start at 0
    assert {name for name, p in module.base_model.named_parameters() if p.requires_grad} == {
        name for name, _ in module.base_model.named_parameters() if "lora_" in name
    }


def test_the_teacher_pass_is_the_original_model_and_the_student_pass_is_not(trained):
    module, _ = trained
    fresh, tokenizer = load_base(TINY_BASE, fast=False)  # the products training takes, as the module's base does
    ids = tokenizer("Count from 3 to 40: 3, 4, 5, 6,", return_tensors="pt").input_ids
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    module.eval()
    with torch.no_grad():
        original = fresh.get_decoder()(**batch).last_hidden_state
        with module.base_model.disable_adapter():
            assert torch.equal(module.backbone(batch), original)
        assert not torch.allclose(module.backbone(batch), original, atol=1e-4)


def test_the_drift_term_is_zero_for_untrained_adapters_and_the_heads_loss_warms_up():
    module = DrafterModule(
        TINY_BASE, drafter=DrafterSettings(num_heads=2), lora=LORA
    )  # heads_warmup_steps 2: weight 1/2 at the first step
    data = DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4)
    data.setup("fit")
    batch = data.train_dataloader().collate_fn(data.train_batches[0])
    with torch.no_grad():
        kl, agreement = module.drift(batch, module.hidden_states(batch))
        assert float(kl) == pytest.approx(0, abs=1e-6) and float(agreement) == 1  # lora_B starts at zero
        assert float(module._step(batch, "train")) == pytest.approx(float(module._step(batch, "val")) / 2)


def test_checkpoints_hold_heads_and_adapters_never_base_weights_and_resume(trained, tmp_path):
    module, root = trained
    saved = torch.load(root / "ckpt" / "last.ckpt", weights_only=False)
    keys = saved["state_dict"].keys()
    assert any("lora_A" in key for key in keys) and any(key.startswith("drafter.") for key in keys)
    assert all(key.startswith(("drafter.", "metrics.", "rank_accuracy.")) or "lora_" in key for key in keys)
    assert len(saved["optimizer_states"][0]["param_groups"]) == 2  # heads at 4x the adapters' learning rate
    groups = saved["optimizer_states"][0]["param_groups"]
    assert groups[0]["initial_lr"] == pytest.approx(4 * groups[1]["initial_lr"])
    resumed = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=2), optim=Optim(lr=3e-2), lora=LORA)
    (checkpoint,) = (root / "ckpt").glob("*step=3.ckpt")
    assert fit(resumed, tmp_path, 6, ckpt_path=checkpoint).global_step == 6
    restored = torch.load(checkpoint, weights_only=False)["state_dict"]
    after = resumed.state_dict()
    assert not all(torch.equal(after[key], value) for key, value in restored.items() if "lora_" in key)  # trained on


def test_the_heads_folder_holds_the_adapter_and_decodes_as_the_adapted_models_own_greedy_search(trained):
    _, root = trained
    folder = root / "heads"
    config = json.loads((folder / "config.json").read_text())
    assert config["adapter"] and config["base_weights"]
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    assert not list(folder.glob("*.bin"))
    decoder = mtp.load(str(folder), tree="medium")
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(load_base(TINY_BASE)[0], folder).merge_and_unload()
    original, tokenizer = load_base(TINY_BASE)
    for prompt in ("Count from 3 to 40: 3, 4, 5, 6,", "List the days of the week."):
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            assert not torch.allclose(adapted(input_ids).logits, original(input_ids).logits, atol=1e-4)
        assert decoder.generate(prompt, max_new_tokens=24).token_ids == reference(adapted, input_ids, 24)


def test_heads_with_an_adapter_refuse_a_base_with_other_weights_naming_both(trained, tmp_path):
    _, root = trained
    other, tokenizer = load_base(TINY_BASE)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight[0, 0] += 0.5  # same sizes and tokenizer, other weights
    other.save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    with pytest.raises(
        ValueError, match=r"adapter was trained on the weights of .*tiny-llama.* not on those of .*other"
    ):
        mtp.load(str(root / "heads"), base_model=str(tmp_path / "other"))


def test_drift_measures_how_far_the_adapter_moved_the_model(trained, tmp_path):
    _, root = trained
    data = DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4, val_fraction=0.125)
    data.setup("validate")
    moved = drift(str(root / "heads"), data.val_examples, prompts=2, max_new_tokens=8)
    assert moved["answer_tokens"] > 0 and moved["prompts"] == 2 and moved["kl"] > 1e-4
    untrained = DrafterModule(
        TINY_BASE, drafter=DrafterSettings(num_heads=2), lora=LORA
    )  # lora_B is zero: the adapted model is the original
    untrained.drafter.save_pretrained(tmp_path / "zero")
    untrained.base_model.save_pretrained(tmp_path / "zero")
    still = drift(str(tmp_path / "zero"), data.val_examples, prompts=2, max_new_tokens=8)
    assert still["agreement"] == 1 and still["kl"] == pytest.approx(0, abs=1e-6) and still["identical"] == 1
    DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=2)).drafter.save_pretrained(tmp_path / "frozen")
    with pytest.raises(ValueError, match="has no adapter"):
        drift(str(tmp_path / "frozen"), data.val_examples, 0, 8)


def test_bad_lora_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"lora.target_modules \['query'\].*choose among \[.*'q_proj'"):
        DrafterModule(TINY_BASE, lora=Lora(target_modules=["q_proj", "query"]))
    with pytest.raises(ValueError, match="features with lora"):
        DrafterModule(TINY_BASE, features="features", lora=LORA)


def test_adapters_on_the_last_layers_only_train_there_and_round_trip(tmp_path):
    torch.manual_seed(0)
    lora = Lora(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], last_layers=1)
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=2), optim=Optim(lr=3e-2), lora=lora)
    depth = module.base_model.config.num_hidden_layers
    fit(module, tmp_path, 3)
    trained = {name: p for name, p in module.base_model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 2 and all(f".layers.{depth - 1}." in name for name in trained)  # last layer: q, v
    assert all(p.abs().sum() > 0 for name, p in trained.items() if "lora_B" in name)  # they start at 0
    from peft import PeftModel

    folder = tmp_path / "heads"
    base, tokenizer = load_base(TINY_BASE)
    adapted = PeftModel.from_pretrained(base, folder).merge_and_unload()
    prompt = "Count from 3 to 40: 3, 4, 5, 6,"
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    decoder = mtp.load(str(folder), tree="medium")
    assert decoder.generate(prompt, max_new_tokens=16).token_ids == reference(adapted, input_ids, 16)
    with pytest.raises(ValueError, match=rf"lora.last_layers {depth + 1}: .* {depth} decoder layers; choose 1 to"):
        DrafterModule(TINY_BASE, lora=Lora(last_layers=depth + 1))


def test_training_can_start_from_saved_heads_of_the_same_kind(trained):
    _, root = trained
    saved = Drafter.from_pretrained(root / "heads")
    module = DrafterModule(
        TINY_BASE, drafter=DrafterSettings(num_heads=2, init=str(root / "heads")), lora=LORA
    )  # Medusa-2's stage 2
    assert all(torch.equal(module.drafter.state_dict()[name], tensor) for name, tensor in saved.state_dict().items())
    with pytest.raises(ValueError, match=r"holds num_heads 2.*this model has num_heads 3.*set the same"):
        DrafterModule(TINY_BASE, drafter=DrafterSettings(num_heads=3, init=str(root / "heads")))
