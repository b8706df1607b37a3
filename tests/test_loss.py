import torch

from mtp.training.loss import IGNORE, default_weights, head_targets, summed_cross_entropy, weighted


def heads_loss(logits, targets, weights, teacher=None):
    """The multi-head loss as training makes it from one chunk: (total, per-head means)."""
    return weighted(summed_cross_entropy(logits, targets, teacher), targets, weights)


VOCAB = 11


def one_hot_logits(targets: torch.Tensor, scale: float = 50.0) -> torch.Tensor:
    """(K, N) targets -> (K, N, V) logits that put all mass on each target (IGNORE -> token 0)."""
    return torch.nn.functional.one_hot(targets.clamp(min=0), VOCAB).float() * scale


def test_head_k_at_position_t_targets_token_t_plus_k_plus_2():
    input_ids = torch.arange(10).unsqueeze(0)  # token value == position
    targets = head_targets(input_ids, torch.ones_like(input_ids, dtype=torch.bool), num_heads=3)  # (K, B, T)
    for k in range(3):
        for t in range(10):
            expected = t + k + 2 if t + k + 2 < 10 else IGNORE
            assert targets[k, 0, t] == expected


def test_aligned_logits_give_near_zero_loss_and_shifted_logits_a_large_one():
    torch.manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    targets = head_targets(input_ids, mask, num_heads=4).flatten(1)  # (K, N)
    aligned, _ = heads_loss(one_hot_logits(targets), targets, default_weights(4))
    assert aligned < 1e-6
    # predicting t+k+1 (one position too early) instead of t+k+2
    early = head_targets(torch.cat([input_ids[:, :1], input_ids[:, :-1]], 1), mask, num_heads=4).flatten(1)
    shifted, per_head = heads_loss(one_hot_logits(early), targets, default_weights(4))
    assert shifted > 10 and (per_head > 1).all()


def test_masked_positions_contribute_nothing():
    torch.manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (1, 12))
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    mask[0, 6:9] = False  # e.g. a user turn in the middle
    targets = head_targets(input_ids, mask, num_heads=2).flatten(1)  # (K, N)
    assert (targets[0, 4:7] == IGNORE).all() and (targets[1, 3:6] == IGNORE).all()
    logits = torch.randn(2, 12, VOCAB)
    loss, _ = heads_loss(logits, targets, [1.0, 0.5])
    garbled = logits.clone()
    garbled[targets == IGNORE] = torch.randn_like(garbled[targets == IGNORE]) * 100
    assert torch.equal(heads_loss(garbled, targets, [1.0, 0.5])[0], loss)


def test_weights_scale_each_head():
    targets = torch.tensor([[1, 2], [3, 4]])
    logits = torch.zeros(2, 2, VOCAB)  # uniform: each head's loss is log(V)
    loss, per_head = heads_loss(logits, targets, [1.0, 0.25])
    assert torch.allclose(per_head, torch.full((2,), torch.log(torch.tensor(VOCAB * 1.0))))
    assert torch.isclose(loss, 1.25 * per_head[0])
    assert default_weights(3, 0.5) == [1.0, 0.5, 0.25]
