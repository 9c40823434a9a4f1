"""The DiffusionGemma-format built-in model's pieces of the training recipe: its config from the
training settings, its initial weights and its examples (the objective is tinymodels/dg_objective.py,
the optimizer tinymodels.optim.matrix_decay_adamw, the loop tinymodels/train.py)."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.gemma4_config import FULL, SLIDING
from engine.special_tokens import SpecialTokens
from tinymodels import char_tokenizer as chars
from tinymodels.dg_objective import CanvasRows, encode_canvas_rows
from tinymodels.formats import diffusion_gemma_config, diffusion_gemma_generation_config
from tinymodels.prompt_forms import prompt_text
from tinymodels.tasks import Problem
from tinymodels.train_config import TrainConfig


def layer_types(config: TrainConfig) -> list[str]:
    """Every `full_every`-th layer attends to everything, the others through the sliding window; the
    last layer is always full (the config class forces it)."""
    last = config.layers - 1
    return [FULL if (i + 1) % config.full_every == 0 or i == last else SLIDING for i in range(config.layers)]


def hf_config(config: TrainConfig) -> dict[str, Any]:
    end_id = chars.special_id(chars.END)
    return diffusion_gemma_config(
        config.d_model, layer_types(config), config.heads, config.kv_heads or max(1, config.heads // 2),
        config.d_model // config.heads, config.full_head_dim, 1, config.mlp_hidden, config.experts,
        config.experts_per_token, config.expert_hidden, len(chars.vocabulary()), config.canvas_length,
        config.sliding_window, eos_id=end_id, pad_id=end_id, sliding_rope_theta=config.rope_theta)


def generation_config() -> dict[str, Any]:
    end_id = chars.special_id(chars.END)
    return diffusion_gemma_generation_config(eos_id=end_id, pad_id=end_id)


def build_model(config: TrainConfig) -> tuple[DiffusionGemmaModel, dict[str, Any]]:
    """Fresh weights: matrices ~ N(0, 0.02), every vector (RMSNorm weights, which scale as they are,
    not as 1 + w; the router's scales) 1. The per-layer `layer_scalar`s are buffers in the official
    model, not trained: they stay 1 here too."""
    hf = hf_config(config)
    end_id = chars.special_id(chars.END)
    special = SpecialTokens(mask_id=None, eos_ids=(end_id,), pad_id=end_id)
    torch.manual_seed(config.seed)
    model = DiffusionGemmaModel(DiffusionGemmaModel.parse_config(hf), special, hf)
    for name, param in model.named_parameters():
        if name.endswith(("encoder_scalar", "decoder_scalar")):
            torch.nn.init.ones_(param)
            param.requires_grad_(False)
        elif param.dim() == 1:
            torch.nn.init.ones_(param)
        else:
            torch.nn.init.normal_(param, std=0.02)
    return model, hf


def encode_examples(batch: list[Problem], plain: list[bool], canvas_length: int) -> CanvasRows:
    """The examples' rows, prompted in chat or plain form (`plain[i]`) as the server sends them."""
    tokenizer = chars.build_tokenizer()
    forms = ["plain" if bare else "chat" for bare in plain]
    prompts = [e.ids for e in tokenizer.encode_batch(
        [prompt_text(p.prompt, form) for p, form in zip(batch, forms, strict=True)], add_special_tokens=False)]
    responses = [e.ids for e in tokenizer.encode_batch([p.response for p in batch], add_special_tokens=False)]
    return encode_canvas_rows(prompts, responses, canvas_length, chars.special_id(chars.END))
