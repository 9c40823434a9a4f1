"""The uniform-noise block-diffusion objective (tinymodels/dg_objective.py) on hand-built examples:
the rows, the corruption, the encoder's and decoder's masks, and the self-conditioning path."""

from __future__ import annotations

import pytest
import torch

from engine.models.gemma4_config import FULL, SLIDING
from tinymodels import dg_objective
from tinymodels.dg_objective import (
    MIN_TIME,
    CanvasRows,
    corrupt,
    decoder_masks,
    encode_canvas_rows,
    encoder_masks,
    uniform_noise_loss,
)
from tinymodels.dg_recipe import build_model
from tinymodels.train_config import TrainConfig

END = 9


def test_rows_cut_responses_into_canvases_with_one_end_token_and_end_fill():
    rows = encode_canvas_rows([[1, 2, 3], [4]], [[5, 6, 7], [5, 6, 7, 8]], canvas_length=2, end_id=END)
    # row 0: 3 response tokens + end = 4 = two whole canvases; row 1: 4 + end -> three canvases
    assert rows.clean.tolist() == [[1, 2, 3, 5, 6, 7, END], [4, 5, 6, 7, 8, END, END]]
    assert rows.clean_valid.tolist() == [[True] * 7, [True] * 7]
    padded = encode_canvas_rows([[1, 2, 3], [4]], [[5], [5]], canvas_length=2, end_id=END)
    assert padded.clean.tolist() == [[1, 2, 3, 5, END], [4, 5, END, END, END]]  # right-padded with end tokens
    assert padded.clean_valid.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert rows.prompt_lengths.tolist() == [3, 1]
    assert rows.targets.tolist() == [[5, 6, 7, END, END, END], [5, 6, 7, 8, END, END]]
    assert rows.canvas_valid.tolist() == [[True] * 4 + [False] * 2, [True] * 6]
    exact = encode_canvas_rows([[1]], [[5, 6, 7]], canvas_length=4, end_id=END)
    assert exact.targets.tolist() == [[5, 6, 7, END]]  # the end token closes a full canvas


def test_corruption_replaces_each_token_with_its_canvas_probability_uniformly_over_the_vocabulary():
    vocab, canvas_length = 50, 4000
    targets = torch.zeros(2, 3 * canvas_length, dtype=torch.long)
    noisy, t = corrupt(targets, canvas_length, vocab, torch.Generator().manual_seed(0))
    assert t.shape == (2, 3) and bool(((t >= MIN_TIME) & (t <= 1 - MIN_TIME)).all())
    assert int(noisy.min()) >= 0 and int(noisy.max()) < vocab
    changed = (noisy != targets).float().view(2, 3, canvas_length).mean(-1)
    # a replaced token is uniform, so it is the original with probability 1 / vocab
    torch.testing.assert_close(changed, t * (1 - 1 / vocab), atol=0.03, rtol=0)
    replaced_ids = noisy[noisy != 0]
    counts = torch.bincount(replaced_ids, minlength=vocab)[1:].float()
    assert float(counts.std() / counts.mean()) < 0.25  # roughly uniform over the other ids


def test_corruption_is_the_same_for_the_same_generator_seed():
    targets = torch.arange(24).view(2, 12) % 7
    a, ta = corrupt(targets, 4, 7, torch.Generator().manual_seed(3))
    b, tb = corrupt(targets, 4, 7, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and torch.equal(ta, tb)


def test_encoder_masks_are_causal_over_real_keys_and_windowed_in_sliding_layers():
    valid = torch.tensor([[True, True, True, True, False]])
    masks = encoder_masks(valid, window=2)
    full = [[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0]]
    sliding = [[1, 0, 0, 0, 0],
               [1, 1, 0, 0, 0],
               [0, 1, 1, 0, 0],
               [0, 0, 1, 1, 0],
               [0, 0, 0, 1, 0]]
    assert masks[FULL][0, 0].int().tolist() == full
    assert masks[SLIDING][0, 0].int().tolist() == sliding


def test_decoder_masks_see_the_clean_positions_before_the_canvas_and_the_whole_canvas():
    # one row: prompt of 3 tokens, two canvases of 2; clean row of 7 real positions
    rows = CanvasRows(clean=torch.zeros(1, 7, dtype=torch.long), clean_valid=torch.ones(1, 7, dtype=torch.bool),
                      prompt_lengths=torch.tensor([3]), targets=torch.zeros(1, 4, dtype=torch.long),
                      canvas_valid=torch.ones(1, 4, dtype=torch.bool), canvas_length=2)
    masks = decoder_masks(rows, window=3)  # sliding layers: the 2 positions just before the canvas
    #        clean 0..6             noisy 0..3
    full = [[1, 1, 1, 0, 0, 0, 0,   1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0,   1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0, 0,   0, 0, 1, 1],
            [1, 1, 1, 1, 1, 0, 0,   0, 0, 1, 1]]
    sliding = [[0, 1, 1, 0, 0, 0, 0,   1, 1, 0, 0],
               [0, 1, 1, 0, 0, 0, 0,   1, 1, 0, 0],
               [0, 0, 0, 1, 1, 0, 0,   0, 0, 1, 1],
               [0, 0, 0, 1, 1, 0, 0,   0, 0, 1, 1]]
    assert masks[FULL][0, 0].int().tolist() == full
    assert masks[SLIDING][0, 0].int().tolist() == sliding


def test_decoder_masks_never_see_right_padding():
    rows = encode_canvas_rows([[1, 2, 3, 4], [1]], [[5], [5]], canvas_length=2, end_id=END)
    masks = decoder_masks(rows, window=8)
    width = rows.clean.shape[1]
    assert not bool(masks[FULL][1, 0, :, 3:width].any())  # row 1's clean row ends at position 3


def _tiny_model():
    config = TrainConfig(arch="diffusion_gemma", d_model=16, layers=2, heads=2, mlp_hidden=16, canvas_length=2,
                         sliding_window=4, full_head_dim=8, experts=2, expert_hidden=4)
    return build_model(config)[0]


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_self_conditioning_feeds_a_detached_first_pass_to_the_conditioned_rows(monkeypatch, share):
    model = _tiny_model()
    rows = encode_canvas_rows([[1, 2, 3], [4, 5]], [[6, 7, 8], [6]], canvas_length=2, end_id=END)
    calls = []
    real = dg_objective.decoder_forward

    def spy(model_, noisy, positions, context, masks, soft):
        logits = real(model_, noisy, positions, context, masks, soft)
        calls.append({"grad": torch.is_grad_enabled(), "rows": len(noisy), "soft": soft, "logits": logits})
        return logits

    monkeypatch.setattr(dg_objective, "decoder_forward", spy)
    loss = uniform_noise_loss(model, rows, torch.Generator().manual_seed(0), share, encoder_loss_weight=1.0)
    if share == 0.0:  # no row conditioned: no first pass, no signal
        assert len(calls) == 1 and calls[0]["soft"] is None and calls[0]["grad"]
    else:
        first, second = calls
        assert not first["grad"] and first["soft"] is None and first["rows"] == 2
        assert second["grad"]
        expected = model.soft_embeddings(first["logits"])  # the raw logits' softmax, as officially trained
        torch.testing.assert_close(second["soft"], expected)
    loss.backward()
    assert model.embed.weight.grad is not None
    grad = model.self_conditioning.mlp.down_proj.weight.grad  # the signal's MLP learns only from conditioned rows
    assert (grad is not None and bool(grad.any())) == (share == 1.0)


def test_unconditioned_rows_get_an_exactly_zero_signal():
    model = _tiny_model()
    embeds = torch.randn(2, 3, 16)
    soft = torch.zeros(2, 3, 16)
    assert torch.equal(model.self_conditioning.forward(embeds, soft), model.self_conditioning.forward(embeds, None))
