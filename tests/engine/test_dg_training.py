"""Training the DiffusionGemma-format built-in model: the objective's two forwards are exactly the
model's cached `encode` / `decode` (the passes inference runs), the checkpoint written is the
official layout the loader and `inspect` accept, and a smoke training's loss falls and resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engine import load_model, load_tokenizer
from engine.decoding.draws import GeneratorDraws
from engine.inspect import describe_checkpoint
from engine.loading.checkpoint import CheckpointFiles
from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.weight_names import expected_weights
from tinymodels.dg_objective import corrupt, decoder_forward, decoder_masks, encode_canvas_rows, encoder_forward
from tinymodels.dg_recipe import build_model, layer_types
from tinymodels.dg_reference import OfficialSettings, generate
from tinymodels.train import train
from tinymodels.train_config import TrainConfig

END = 98


def _small(steps: int = 50, **overrides) -> TrainConfig:
    settings = dict(arch="diffusion_gemma", d_model=32, layers=2, heads=2, mlp_hidden=48, canvas_length=4,
                    sliding_window=6, full_head_dim=16, experts=3, expert_hidden=8, batch_size=8, steps=steps,
                    warmup=5, checkpoint_every=10)
    return TrainConfig(**{**settings, **overrides})


def _random_model() -> DiffusionGemmaModel:
    """Weights far from the initial ones (norm weights, scalars, encoder != decoder scalars), so a
    wrong detail in the training forwards moves the logits."""
    model, _ = build_model(_small(layers=3))  # sliding, full, full
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            else:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def test_the_training_forwards_are_the_models_cached_encoder_and_decoder_passes():
    model = _random_model()
    assert model.layers[0].encoder_scalar.item() != model.layers[0].decoder_scalar.item()
    window = model.gemma.sliding.window
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # the longer prompt overflows the sliding ring
    responses = [[20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    rows = encode_canvas_rows(prompts, responses, model.canvas_length, END)
    noisy, _ = corrupt(rows.targets, model.canvas_length, model.config.vocab_size, torch.Generator().manual_seed(1))
    span, length = rows.targets.shape[1], model.canvas_length
    with torch.no_grad():
        hidden, context = encoder_forward(model, rows)
        positions = rows.prompt_lengths[:, None] + torch.arange(span)
        masks = decoder_masks(rows, window)
        soft = model.soft_embeddings(torch.randn(2, span, model.config.vocab_size,
                                                 generator=torch.Generator().manual_seed(2)))
        with_signal = decoder_forward(model, noisy, positions, context, masks, soft)
        without = decoder_forward(model, noisy, positions, context, masks, None)
        for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            real = len(prompt) + (len(response) + length) // length * length
            states: list[torch.Tensor] = []
            model.encode(rows.clean[row:row + 1, :real], model.new_cache(1, 64), hidden_states_out=states)
            torch.testing.assert_close(states[-1][0], hidden[row, :real], atol=1e-5, rtol=0)
            cache = model.new_cache(1, 64)
            model.encode(rows.clean[row:row + 1, :len(prompt)], cache)  # prefill, then one commit per canvas
            for start in range(0, real - len(prompt), length):
                canvas = slice(start, start + length)
                ours = model.decode(noisy[row:row + 1, canvas], cache, self_conditioning=soft[row:row + 1, canvas])
                torch.testing.assert_close(ours, with_signal[row:row + 1, canvas], atol=1e-4, rtol=0)
                torch.testing.assert_close(model.decode(noisy[row:row + 1, canvas], cache),
                                           without[row:row + 1, canvas], atol=1e-4, rtol=0)
                model.encode(rows.targets[row:row + 1, canvas], cache)


def test_layer_types_put_full_attention_every_nth_layer_and_last():
    assert layer_types(_small(layers=5, full_every=2)) == ["sliding_attention", "full_attention"] * 2 + [
        "full_attention"]
    assert layer_types(_small(layers=3, full_every=5)) == ["sliding_attention"] * 2 + ["full_attention"]


@pytest.mark.slow
def test_smoke_training_loss_falls_and_the_checkpoint_is_the_official_layout(tmp_path):
    config = _small(steps=50)
    log = train(config, tmp_path, progress=False)
    losses = [loss for _, loss in log["losses"]]  # means over 25 steps each
    assert losses[-1] < 0.8 * losses[0]
    assert log["cpu_seconds"] > 0
    model = load_model(tmp_path)
    assert isinstance(model, DiffusionGemmaModel) and model.canvas_length == config.canvas_length
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["DiffusionGemmaForBlockDiffusion"] and "auto_map" not in hf
    assert hf["text_config"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert hf["text_config"]["per_layer_config"] == {"1": {"head_dim": 16, "num_key_value_heads": 1}}
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["sampler_config"] == {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1}
    assert gen["eos_token_id"] == [END] and gen["pad_token_id"] == END
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(expected_weights(model.config))  # every official name, nothing else
        assert not any(name.startswith("model.decoder.layers.1.self_attn.v_proj") for name in f.keys())  # k_eq_v
    tokenizer = load_tokenizer(tmp_path)
    special = CheckpointFiles.open(tmp_path).special_tokens(needs_mask=False)
    assert special.eos_ids == (tokenizer.convert_tokens_to_ids("<|end|>"),) == (END,)
    report = describe_checkpoint(tmp_path)
    assert report["architecture"] == "DiffusionGemma" and report["weights"]["status"] == "ok"
    settings = OfficialSettings.from_generation_config({**gen, "max_new_tokens": 8, "max_denoising_steps": 3})
    prompt = torch.tensor([tokenizer.encode("00457+00038", add_special_tokens=False)])
    out = generate(model, prompt, settings, GeneratorDraws(torch.Generator().manual_seed(0), 102))
    assert out.tokens.shape == (1, 8) and out.steps_per_canvas == [3, 3]


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    config = _small(steps=12)
    straight = train(config, tmp_path / "straight", progress=False)
    assert train(config, tmp_path / "resumed", progress=False, stop_at=6)["step"] == 6
    resumed = train(config, tmp_path / "resumed", resume=True, progress=False)
    assert resumed["losses"] == straight["losses"]
    a, b = load_model(tmp_path / "straight").state_dict(), load_model(tmp_path / "resumed").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
