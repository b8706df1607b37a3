"""The drafter contract (`mtp.drafters.contract.Drafter`): a kind of drafter that no module of mtp knows, defined
here, trains, saves and loads, sizes and decodes losslessly, with no edit anywhere else."""

import pytest
import torch
from torch import nn

from mtp.base import load_tokenizer
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import FULL_REACH, Lookup
from mtp.decoding.proposer import TreeProposer
from mtp.decoding.tree import Tree
from mtp.drafters.contract import Drafter
from mtp.tools.simulate import held_out_roots, simulate
from mtp.training.data import DrafterDataModule
from mtp.training.module import DrafterModule
from mtp.training.settings import DrafterSettings, Optim
from tests.conftest import PROMPT, TINY_BASE, TINY_CHAT, reference, trainer

PATHS = [(0,), (1,), (0, 0), (0, 1), (1, 0)]


class ProbeProposer(TreeProposer):
    """The probe over the rows of a batch: each row's last hidden state is all it reads."""

    name = "probe"

    def __init__(self, probe: Drafter, target, cut: dict):
        super().__init__(target, cut)
        self.probe, self.hidden = probe, []

    def add(self, input_ids, states, root):
        self.hidden.append(states.last[0, -1])

    def expand(self, draft, nodes, depth, k):
        state = self.probe.maps[depth - 1](torch.stack(self.hidden))  # (B, H)
        logp, best = self.target.lm_head(state).float().log_softmax(-1).topk(k, dim=-1)  # (B, k)
        return best[:, None].expand(-1, nodes.shape[1], -1), logp[:, None].expand(-1, nodes.shape[1], -1)

    def accept(self, states, nodes, settled):
        self.hidden = [states.last[b, row_nodes[-1]] for b, row_nodes in enumerate(nodes)]

    def keep(self, rows):
        self.hidden = [hidden for hidden, kept in zip(self.hidden, rows, strict=True) if kept]


@pytest.fixture
def probe():
    """A new kind, `probe`: step k is a linear map of the base model's last hidden state at t, scored by the base
    lm_head for token t + k + 2. Registered for this test only."""

    class Probe(Drafter, kind="probe"):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.maps = nn.ModuleList(
                nn.Linear(config.hidden_size, config.hidden_size, bias=False) for _ in range(config.num_heads)
            )
            for linear in self.maps:
                nn.init.eye_(linear.weight)

        @classmethod
        def new(cls, config, base_model):
            return cls(config)

        @property
        def max_depth(self):
            return self.config.num_heads

        def teacher_forced(self, hidden, features, input_ids, keep, embed):
            return torch.stack([linear(hidden[keep]) for linear in self.maps])  # (K, N, H)

        def project(self, states, base_lm_head):
            return base_lm_head(states)

        def path_guesses(self, hidden, features, input_ids, base_lm_head, embed, k):
            return torch.stack([base_lm_head(linear(hidden)).topk(k, dim=-1).indices for linear in self.maps])

        def proposer(self, target, cut):
            return ProbeProposer(self, target, cut)

    yield Probe
    del Drafter.kinds["probe"]


def test_a_kind_of_drafter_defined_here_trains_saves_sizes_and_decodes_losslessly(tmp_path, probe):
    module = DrafterModule(TINY_BASE, drafter=DrafterSettings(head_type="probe", num_heads=2), optim=Optim(lr=1e-2))
    base = {name: tensor.clone() for name, tensor in module.base_model.state_dict().items()}
    before = {name: tensor.clone() for name, tensor in module.drafter.state_dict().items()}
    trainer(tmp_path, max_steps=4, limit_val_batches=1).fit(
        module, DrafterDataModule(TINY_CHAT, TINY_BASE, batch_size=4)
    )
    assert all(not torch.equal(tensor, before[name]) for name, tensor in module.drafter.state_dict().items())
    assert all(torch.equal(tensor, base[name]) for name, tensor in module.base_model.state_dict().items())
    loaded = Drafter.from_pretrained(tmp_path / "heads").eval()
    assert type(loaded) is probe and loaded.config.head_type == "probe"
    for name, tensor in module.drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    model, tokenizer = module.base_model, load_tokenizer(TINY_BASE)
    prompts = [PROMPT, "Repeat after me: one two three, one two three, one two"]
    decoder = Decoder(model, tokenizer, loaded, Tree.from_paths(PATHS), Lookup((0, 3, 10)))
    results = [decoder.generate(prompt, max_new_tokens=30) for prompt in prompts]
    examples = []
    for prompt, result in zip(prompts, results, strict=True):
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = reference(model, input_ids, 30)
        count = len(result.token_ids)  # the whole output: 30 tokens, or up to the end of the answer
        assert result.token_ids == expected[:count] and (count == 30 or expected[count] in decoder.target.eos_ids)
        ids = torch.tensor(input_ids[0].tolist() + result.token_ids)
        examples.append((ids, torch.arange(len(ids)) >= input_ids.shape[1]))
    # sizing simulates on the answers the steps that decoding took with them
    with torch.no_grad():
        roots = held_out_roots(model, loaded, PATHS, examples, Lookup((FULL_REACH,) * 3))
    tokens, steps, _ = simulate(roots, len(PATHS) + 1, [0, 3, 10], [1.0] * 30)
    assert steps == sum(result.forward_passes for result in results)
    assert tokens == sum(len(result.token_ids) - 1 for result in results)
