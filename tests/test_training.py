"""A short smoke training of each format: the loss falls, the checkpoint loads, resuming is exact."""

from __future__ import annotations

import json

import pytest
import torch

from engine import load_model, load_tokenizer
from engine.loading.checkpoint import CheckpointFiles
from tinymodels.train import TrainConfig, masked_diffusion_loss, train


def _small(arch: str, steps: int, optimizer: str = "adamw") -> TrainConfig:
    return TrainConfig(arch=arch, d_model=48, layers=2, heads=4, mlp_hidden=96, batch_size=8, steps=steps,
                       lr=3e-3, warmup=5, checkpoint_every=10, optimizer=optimizer)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "optimizer"), [("llada", "adamw"), ("dream", "adamw"), ("llada", "muon")])
def test_smoke_training_loss_falls_and_checkpoint_loads(arch, optimizer, tmp_path):
    log = train(_small(arch, 100, optimizer), tmp_path, progress=False)
    losses = [loss for _, loss in log["losses"]]
    assert losses[-1] < 0.6 * losses[0]
    model = load_model(tmp_path)
    assert model.config.architecture == arch
    assert model.logits_shifted == (arch == "dream")
    tokenizer = load_tokenizer(tmp_path)
    special = CheckpointFiles.open(tmp_path).special_tokens()
    assert special.mask_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert special.eos_id == special.eot_id == tokenizer.convert_tokens_to_ids("<|end|>")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == (["LLaDAModelLM"] if arch == "llada" else ["DreamModel"])
    assert "auto_map" in config
    assert json.loads((tmp_path / "training_log.json").read_text())["step"] == 100


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_exactly(optimizer, tmp_path):
    config = _small("llada", 30, optimizer)
    straight = train(config, tmp_path / "straight", progress=False)
    stopped = train(config, tmp_path / "resumed", progress=False, stop_at=15)
    assert stopped["step"] == 15
    resumed = train(config, tmp_path / "resumed", resume=True, progress=False)
    assert resumed["step"] == 30
    assert resumed["losses"] == straight["losses"]
    a = load_model(tmp_path / "straight").state_dict()
    b = load_model(tmp_path / "resumed").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="another training config"):
        train(_small("llada", 40, optimizer), tmp_path / "resumed", resume=True, progress=False)


class _RecordingModel(torch.nn.Module):
    """Stands in for a model: remembers the noisy input it was given, returns uniform logits."""

    logits_shifted = False

    def __init__(self, vocab: int, mask_id: int) -> None:
        super().__init__()
        self.special = type("Special", (), {"mask_id": mask_id})()
        self.bias = torch.nn.Parameter(torch.zeros(vocab))
        self.seen: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.seen.append(ids.clone())
        return self.bias.expand(*ids.shape, -1)


def test_prefix_masking_keeps_a_response_prefix_visible():
    mask_id, canvas_len, prompt_len = 5, 40, 10
    ids = torch.randint(0, 5, (512, prompt_len + canvas_len))
    attention = torch.ones_like(ids)
    canvas = torch.zeros_like(ids, dtype=torch.bool)
    canvas[:, prompt_len:] = True
    model = _RecordingModel(8, mask_id)
    loss = masked_diffusion_loss(model, ids, attention, canvas, torch.Generator().manual_seed(0), canvas_len,
                                 prefix_mask_share=1.0)
    loss.backward()
    masked = model.seen[0] == mask_id
    assert not masked[:, :prompt_len].any()  # the prompt is never masked
    # a cut drawn uniformly over the canvas: early positions are rarely after it, late ones usually
    rate = masked[:, prompt_len:].float().mean(0)
    assert rate[:8].mean() < 0.5 * rate[-8:].mean()
    first = [int(row.nonzero()[0]) for row in masked[:, prompt_len:] if row.any()]
    assert len(set(first)) > 5  # the cut moves from example to example

    plain = _RecordingModel(8, mask_id)
    masked_diffusion_loss(plain, ids, attention, canvas, torch.Generator().manual_seed(0), canvas_len)
    plain_rate = (plain.seen[0] == mask_id)[:, prompt_len:].float().mean(0)
    assert plain_rate[:8].mean() > 0.7 * plain_rate[-8:].mean()  # LLaDA's draw: uniform over the canvas
    assert (plain.seen[0] == mask_id).sum() > masked.sum()


def test_prefix_mask_share_is_validated():
    with pytest.raises(ValueError, match="prefix_mask_share"):
        TrainConfig(prefix_mask_share=1.5)
