"""Hidden states on disk (offline features): what is written is the base model's states, each example once whatever
the number of processes and however often a run is killed; training on them reaches online training's weights
without the base's decoder layers in memory."""

import json

import pytest
import torch

from mtp.base import load_base, load_tokenizer
from mtp.drafters.contract import base_identity
from mtp.training import features as features_module
from mtp.training.data import DrafterDataModule
from mtp.training.features import Features, backbone, key, manifest, write_features
from mtp.training.module import DrafterModule
from mtp.training.settings import DrafterSettings, Loss, Optim
from tests.conftest import TINY_BASE, TINY_CHAT, trainer

LAYERS = [1]  # one layer's states beside the last: (1 + 1) x 64 values a token


@pytest.fixture(scope="module")
def examples():
    data = DrafterDataModule(TINY_CHAT, TINY_BASE, val_fraction=0.1)
    data.setup("fit")
    return [ids for ids, _ in [*data.train_examples, *data.val_examples]]


@pytest.fixture(scope="module")
def wanted(tiny):
    model, tokenizer = tiny
    return manifest(base_identity(TINY_BASE, model, tokenizer), LAYERS)


def read_all(folder, wanted) -> dict[str, torch.Tensor]:
    found = Features(folder, wanted)
    return {example: found[example] for example in found.where}


def written_keys(folder) -> list[str]:
    """Every key in every part, repeats included."""
    keys = []
    for part in sorted(folder.glob("rank-*/part-*.safetensors")):
        with part.open("rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        keys += json.loads(header["__metadata__"]["keys"])
    return keys


def test_written_states_are_the_base_models_and_the_printed_bytes_per_token_are_on_disk(
    tiny, examples, wanted, tmp_path, capsys
):
    write_features(tmp_path, TINY_BASE, wanted, examples, batch_size=4)
    printed, distinct = capsys.readouterr().out, len({key(ids) for ids in examples})  # the data repeats some rows
    assert f"{2 * 64 * 2:,} bytes a token" in printed and f"{distinct} of {distinct} examples" in printed
    found = read_all(tmp_path, wanted)
    assert sorted(written_keys(tmp_path)) == sorted(found) == sorted({key(ids) for ids in examples})
    model, _ = tiny
    for ids in examples:  # each alone, unpadded, in float32: the disk holds them rounded to bfloat16
        alone = backbone(model, ids[None], torch.ones_like(ids)[None], LAYERS)[0]
        torch.testing.assert_close(found[key(ids)].float(), alone, rtol=2**-8, atol=1e-5)
    tokens = sum(len(states) for states in found.values())
    on_disk = sum(part.stat().st_size for part in tmp_path.glob("rank-*/part-*.safetensors"))
    assert 2 * 64 * 2 <= on_disk / tokens <= 1.02 * 2 * 64 * 2  # the index and header: under 2%


def test_two_ranks_write_what_one_process_writes_each_example_once(examples, wanted, tmp_path):
    write_features(tmp_path / "alone", TINY_BASE, wanted, examples, batch_size=4)
    for rank in (0, 1):
        write_features(tmp_path / "split", TINY_BASE, wanted, examples, rank=rank, world_size=2, batch_size=4)
    assert {p.name for p in (tmp_path / "split").glob("rank-*")} == {"rank-00000", "rank-00001"}
    alone, split = read_all(tmp_path / "alone", wanted), read_all(tmp_path / "split", wanted)
    assert sorted(written_keys(tmp_path / "split")) == sorted(alone)  # no example twice, none lost
    for example, states in alone.items():  # other batches, other padding: equal to bfloat16's rounding
        torch.testing.assert_close(split[example].float(), states.float(), rtol=2**-7, atol=1e-5)


def test_a_run_killed_mid_way_and_rerun_on_another_number_of_processes_writes_each_example_once(
    examples, wanted, tmp_path, monkeypatch
):
    monkeypatch.setattr(features_module, "PART_BYTES", 1)  # a part per batch
    saved = features_module.save_file
    calls = []

    def dies_on_the_third_part(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed while writing a part: its staging file stays behind
        saved(*args, **kwargs)

    monkeypatch.setattr(features_module, "save_file", dies_on_the_third_part)
    with pytest.raises(KeyboardInterrupt):
        write_features(tmp_path, TINY_BASE, wanted, examples, rank=0, world_size=1, batch_size=4)
    assert len(written_keys(tmp_path)) == 8  # two parts of 4
    monkeypatch.setattr(features_module, "save_file", saved)
    for rank in range(3):
        write_features(tmp_path, TINY_BASE, wanted, examples, rank=rank, world_size=3, batch_size=4)
    assert sorted(written_keys(tmp_path)) == sorted({key(ids) for ids in examples})


def test_the_loader_reads_each_batchs_states_in_its_worker_and_the_step_reads_none(
    examples, wanted, tmp_path, monkeypatch
):
    """The batches carry the states read from disk by the loader's worker process (a read in the training process
    fails here), each row's own and zero past its end, and the step takes them from the batch."""
    write_features(tmp_path, TINY_BASE, wanted, examples, batch_size=4)
    features, read = Features(tmp_path, wanted), Features.__getitem__

    def in_a_worker(self, example):
        assert torch.utils.data.get_worker_info() is not None, "hidden states read in the training process"
        return read(self, example)

    monkeypatch.setattr(Features, "__getitem__", in_a_worker)
    data = DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=8, val_fraction=0.1)
    data.setup("fit")
    data.read_features(features)
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(feature_layers=LAYERS), features=str(tmp_path))
    module.features = features  # (as its setup opens them)
    batches = [*data.train_dataloader(), *data.val_dataloader()]
    assert len(batches) == len(data.train_batches) + len(data.val_batches)
    for batch in batches:
        states = module.hidden_states(batch)  # (B, T, W)
        for row, length in enumerate(batch["attention_mask"].sum(1).tolist()):
            assert torch.equal(states[row, :length], read(features, key(batch["input_ids"][row, :length])).float())
            assert not states[row, length:].any()


def test_a_folder_written_for_other_states_is_refused(examples, wanted, tmp_path):
    write_features(tmp_path, TINY_BASE, wanted, examples[:2])
    with pytest.raises(ValueError, match=r"written for layers \[1\]; this run needs layers \[0, 2\].*another folder"):
        write_features(tmp_path, TINY_BASE, {**wanted, "layers": [0, 2]}, examples)


def test_the_base_without_layers_holds_the_whole_bases_embeddings_norm_and_lm_head(tiny, tmp_path):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    light, _ = load_base(str(tmp_path), layers=False)
    assert len(light.get_decoder().layers) == 0 and light.config.num_hidden_layers == 2
    whole = dict(model.named_parameters())
    assert {name for name, _ in light.named_parameters()} == {"model.embed_tokens.weight", "model.norm.weight"}
    for name, weight in light.named_parameters():  # lm_head: tied to the embeddings in the tiny model
        assert torch.equal(weight, whole[name]), name
    assert load_tokenizer(str(tmp_path)).get_vocab() == tokenizer.get_vocab()


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_on_states_from_disk_reaches_online_trainings_weights_without_the_bases_layers(kind, tmp_path):
    drafter, loss = {
        "medusa": (DrafterSettings(num_heads=2), Loss(teacher=True)),
        "eagle": (DrafterSettings("eagle", 2, draft_vocab=60, feature_layers=LAYERS), Loss()),
    }[kind]
    results, starts = {}, {}
    for folder in (None, tmp_path / "features", tmp_path / "features"):  # online, offline, offline again
        torch.manual_seed(0)
        module = DrafterModule(
            TINY_BASE, drafter, loss, Optim(lr=1e-2, warmup_steps=0), features=None if folder is None else str(folder)
        )
        starts[folder] = {name: w.clone() for name, w in module.drafter.state_dict().items()}
        if folder is None:  # online, its states rounded as the disk rounds them: the same inputs, read another way
            whole = module.backbone
            module.backbone = lambda batch, whole=whole: whole(batch).to(torch.bfloat16).float()
        else:
            assert len(module.base_model.get_decoder().layers) == 0
            parts = {p: p.stat().st_mtime_ns for p in folder.glob("rank-*/part-*.safetensors")}
        data = DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=8, val_fraction=0)
        trainer(tmp_path / "run", max_steps=-1, max_epochs=3, limit_val_batches=0).fit(module, data)
        results[len(results)] = module.drafter.state_dict()
    online, offline, again = results.values()
    assert parts and parts == {p: p.stat().st_mtime_ns for p in folder.glob("rank-*/part-*.safetensors")}  # reused
    moved = 0.0
    for name, weight in online.items():
        assert torch.equal(again[name], offline[name]), name
        if not weight.is_floating_point():  # the draft vocabulary's maps
            assert torch.equal(offline[name], weight), name
            continue
        scale = weight.abs().max().item() + 1e-6
        torch.testing.assert_close(offline[name], weight, rtol=0, atol=1e-4 * scale)  # equal here (EPYC, Xeon)
        if starts[None][name].shape == weight.shape:  # (an own lm_head is sized by the draft vocabulary later)
            moved = max(moved, (weight - starts[None][name]).abs().max().item() / scale)
    assert moved > 0.1  # the steps moved the weights by far more than the tolerance
