"""The experts' pair counts (engine/models/moe.py `expert_counts`) on hand-built ids: what bincount
gives, without its read of the largest id (on CUDA a wait for the stream in every MoE layer)."""

import torch

from engine.models.moe import expert_counts


def test_expert_counts_match_bincount_with_empty_and_repeated_experts():
    ids = torch.tensor([3, 0, 3, 3, 5, 0])
    assert expert_counts(ids, 7).tolist() == [2, 0, 0, 3, 0, 1, 0]
    assert torch.equal(expert_counts(ids, 7), torch.bincount(ids, minlength=7))


def test_expert_counts_of_no_pairs_are_zeros():
    assert expert_counts(torch.zeros(0, dtype=torch.long), 4).tolist() == [0, 0, 0, 0]
