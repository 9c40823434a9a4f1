"""Dream (`model_type: Dream`, `DreamModel`): the Qwen2 layout, q/k/v with bias, GQA, RoPE from
`position_ids`. Trained from an AR model, so output i-1 predicts token i (`logits_shifted`); the
forward returns raw logits and the decoder applies the shift, as the official generation code does."""

from __future__ import annotations

from typing import Any

from engine.errors import CheckpointError
from engine.models.config import ModelConfig
from engine.models.transformer import DiffusionTransformer


class DreamModel(DiffusionTransformer):
    architecture = "dream"
    display_name = "Dream"

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> ModelConfig:
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"Dream config field hidden_act={hf.get('hidden_act')!r} is not supported")
        if hf.get("rope_scaling") is not None:
            raise CheckpointError(f"Dream config field rope_scaling={hf['rope_scaling']!r} is not supported")
        if hf.get("use_sliding_window"):
            raise CheckpointError("Dream config field use_sliding_window=true is not supported")
        try:
            heads = int(hf["num_attention_heads"])
            return ModelConfig(
                architecture=cls.architecture,
                hidden_size=int(hf["hidden_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                intermediate_size=int(hf["intermediate_size"]),
                vocab_size=int(hf["vocab_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                qkv_bias=True,  # hard-coded in the official modeling_dream.py; no config flag exists
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                rope_in_float32=False,
                logits_shifted=True,
                max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            )
        except KeyError as err:
            raise CheckpointError(f"Dream config.json is missing the field {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"Dream config.json is invalid: {err}") from None
