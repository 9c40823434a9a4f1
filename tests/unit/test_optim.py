"""The training optimizers: Muon's orthogonalised update, and the pair of optimizers it runs in."""

from __future__ import annotations

import pytest
import torch

from tinymodels.optim import Muon, OptimizerGroup, build_optimizer, orthogonalise
from tinymodels.train import TrainConfig, build_model


@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (48, 48)])
def test_orthogonalise_approximates_the_polar_factor(shape):
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = orthogonalise(matrix)
    assert result.shape == matrix.shape
    singular = torch.linalg.svdvals(result)
    # five quintic iterations bring every singular value near 1, not exactly to it
    assert singular.min() > 0.5 and singular.max() < 1.3
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    polar = u @ vh
    assert torch.linalg.norm(result - polar) / torch.linalg.norm(polar) < 0.3


def test_muon_takes_matrices_only():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(4))], lr=1e-2, weight_decay=0.0)


def test_muon_minimises_a_matrix_objective():
    target = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    weight = torch.nn.Parameter(torch.zeros(16, 8))
    optimizer = Muon([weight], lr=0.2, weight_decay=0.0)
    start = float(((weight.detach() - target) ** 2).sum())
    for _ in range(100):
        optimizer.zero_grad()
        loss = ((weight - target) ** 2).sum()
        loss.backward()
        optimizer.step()
    assert float(((weight.detach() - target) ** 2).sum()) < 0.01 * start


def test_muon_update_has_adamw_rms_and_decays_weights():
    weight = torch.nn.Parameter(torch.ones(32, 8))
    optimizer = Muon([weight], lr=0.1, weight_decay=0.5, momentum=0.0)
    weight.grad = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    before = weight.detach().clone()
    optimizer.step()
    update = weight.detach() - before * (1 - 0.1 * 0.5)
    # an orthogonal 32x8 matrix has RMS 1/sqrt(32); Moonshot's scale 0.2*sqrt(32) makes it 0.2
    assert float(update.pow(2).mean().sqrt()) == pytest.approx(0.1 * 0.2, rel=0.25)


def test_build_optimizer_splits_hidden_matrices_from_the_rest():
    model, _ = build_model(TrainConfig(d_model=32, layers=2, heads=2, mlp_hidden=64))
    optimizer = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.1)
    assert isinstance(optimizer, OptimizerGroup)
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    in_adamw = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert in_muon and all(n.startswith("layers.") and not n.endswith("norm.weight") for n in in_muon)
    assert {"embed.weight", "lm_head.weight", "norm.weight"} <= in_adamw
    assert in_muon | in_adamw == set(names.values()) and not in_muon & in_adamw
    assert len(optimizer.param_groups) == 2
    with pytest.raises(ValueError, match="optimizer must be one of"):
        build_optimizer(model, "sgd", lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TrainConfig(optimizer="sgd")


def test_optimizer_group_state_round_trips():
    model, _ = build_model(TrainConfig(d_model=32, layers=2, heads=2, mlp_hidden=64))
    optimizer = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.1)
    model(torch.randint(0, 90, (2, 12))).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    fresh = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.1)
    fresh.load_state_dict(state)
    assert str(fresh.state_dict()) == str(state)
    with pytest.raises(ValueError, match="optimizers"):
        fresh.load_state_dict({"optimizers": state["optimizers"][:1]})
