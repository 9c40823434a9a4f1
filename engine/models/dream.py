"""Dream (`model_type: Dream`, `DreamModel`): the Qwen2 layout, q/k/v with bias, GQA, RoPE from
`position_ids`. Trained from an AR model, so output i-1 predicts token i (`logits_shifted`); the
forward returns raw logits and the decoder applies the shift, as the official generation code does."""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.config_parsing import config_errors, hf_sizes, refuse_unsupported
from engine.models.transformer import DiffusionTransformer


class DreamModel(DiffusionTransformer):
    architecture = "dream"
    display_name = "Dream"

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> ModelConfig:
        refuse_unsupported("Dream", hf, {"hidden_act": hf.get("hidden_act", "silu") != "silu",
                                         "rope_scaling": hf.get("rope_scaling") is not None,
                                         "use_sliding_window": bool(hf.get("use_sliding_window"))})
        with config_errors("Dream"):
            return ModelConfig(
                architecture=cls.architecture,
                **hf_sizes(hf),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                qkv_bias=True,  # hard-coded in the official modeling_dream.py; no config flag exists
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                rope_in_float32=False,
                logits_shifted=True,
                max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            )
