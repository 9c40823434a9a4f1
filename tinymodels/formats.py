"""Writing checkpoints in the official LLaDA, Dream, SDAR, LLaDA2 and DiffusionGemma formats (config fields,
names, files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import save_file

from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.transformer import DiffusionTransformer
from engine.models.weight_names import expected_weights

TrainedModel = Union[DiffusionTransformer, DiffusionGemmaModel]


def llada_config(d_model: int, n_layers: int, n_heads: int, mlp_hidden: int, vocab_size: int,
                 embedding_size: int, mask_id: int, eos_id: int, max_len: int = 4096,
                 rope_theta: float = 500000.0) -> dict[str, Any]:
    """Every field of the released LLaDA-8B-Instruct config.json, with these sizes and ids, but `auto_map`:
    it names modeling files we do not ship, so every Hugging Face load would ask to run missing code."""
    return {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": d_model,
        "embedding_dropout": 0.0, "embedding_size": embedding_size, "eos_token_id": eos_id,
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
        "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": mask_id,
        "max_sequence_length": max_len, "mlp_hidden_size": mlp_hidden, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": n_heads, "n_kv_heads": n_heads, "n_layers": n_layers,
        "pad_token_id": eos_id, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
        "rope": True, "rope_full_precision": True, "rope_theta": rope_theta, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": vocab_size, "weight_tying": False,
    }


def dream_config(hidden: int, n_layers: int, n_heads: int, n_kv_heads: int, intermediate: int, vocab_size: int,
                 mask_id: int, eos_id: int, max_len: int = 4096, rope_theta: float = 1000000.0) -> dict[str, Any]:
    """Every field of the released Dream-v0-Instruct-7B config.json, with these sizes and ids, but `auto_map`
    (see `llada_config`)."""
    return {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": intermediate, "mask_token_id": mask_id,
        "max_position_embeddings": max_len, "max_window_layers": n_layers, "model_type": "Dream",
        "num_attention_heads": n_heads, "num_hidden_layers": n_layers, "num_key_value_heads": n_kv_heads,
        "pad_token_id": eos_id, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": rope_theta,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.46.2", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def sdar_config(hidden: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, intermediate: int,
                vocab_size: int, mask_id: int, eos_id: int, block_size: int, max_len: int = 4096,
                rope_theta: float = 1000000.0) -> dict[str, Any]:
    """Every field of the released SDAR-8B-Chat config.json, with these sizes and ids, but `auto_map`
    (see `llada_config`). `block_size` is the block the model is trained with."""
    return {
        "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_implementation": "flex_attention", "bos_token_id": eos_id, "debug": False,
        "eos_token_id": eos_id, "block_size": block_size, "mask_token_id": mask_id, "ep_size": 1,
        "fuse_cross_entropy": True, "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": intermediate, "max_position_embeddings": max_len,
        "max_window_layers": n_layers, "micro_forward": False, "model_type": "sdar",
        "num_attention_heads": n_heads, "num_hidden_layers": n_layers, "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": rope_theta, "skip_checkpoint": False,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False,
        "use_sliding_window": False, "vocab_size": vocab_size,
    }


def llada2_config(hidden: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, intermediate: int,
                  vocab_size: int, pad_id: int, experts: int, experts_per_token: int, expert_intermediate: int,
                  shared_experts: int, dense_layers: int, groups: int, groups_per_token: int,
                  max_len: int = 16384, rope_theta: float = 600000.0,
                  block_size: Optional[int] = None) -> dict[str, Any]:
    """Every field of the released LLaDA2 mini config.json (the Hub's key order and `model_type:
    llada2_moe`, tests/fixtures/real/llada2.0-mini/), with these sizes, but `auto_map` (see
    `llada_config`); `block_size`, the trained block, appended when given (the released file names
    none: its decoders take 32, engine/models/llada2.py). Like the released file it names no mask or
    eos id: the official `generate()` takes them as arguments; the engine reads them from the
    tokenizer files beside it. The router keys the official code never reads (`score_function`,
    `router_dtype`, ...) keep the real values."""
    return {
        "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0, "dtype": "float32",
        "embedding_dropout": 0.0, "first_k_dense_replace": dense_layers, "head_dim": head_dim, "hidden_act": "silu",
        "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": intermediate,
        "max_position_embeddings": max_len, "max_window_layers": n_layers, "model_type": "llada2_moe",
        "moe_intermediate_size": expert_intermediate, "moe_router_enable_expert_bias": True, "n_group": groups,
        "norm_head": False, "norm_softmax": False, "norm_topk_prob": True, "num_attention_heads": n_heads,
        "num_experts": experts, "num_experts_per_tok": experts_per_token, "num_hidden_layers": n_layers,
        "num_key_value_heads": n_kv_heads, "num_shared_experts": shared_experts, "output_dropout": 0.0,
        "output_router_logits": False, "pad_token_id": pad_id, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": rope_theta, "rotary_dim": head_dim // 2, "routed_scaling_factor": 2.5,
        "router_dtype": "fp32", "score_function": "sigmoid", "sliding_window": 4096, "tie_word_embeddings": False,
        "topk_group": groups_per_token, "transformers_version": "4.57.0", "use_bias": False, "use_cache": False,
        "use_qk_norm": True, "use_qkv_bias": False, "use_rmsnorm": True, "use_sliding_window": False,
        "vocab_size": vocab_size, **({} if block_size is None else {"block_size": block_size}),
    }


def _image_token_ids(vocab_size: int) -> dict[str, int]:
    """DiffusionGemma's top-level image-token ids for a text-only vocabulary: the first ids past it, so
    no text token is ever taken for an image. They must be ids, not null: the official `generate()`
    checks `(input_ids == config.image_token_id).any()` on every call, which a null id turns into a
    Python bool without `.any()`."""
    return {"boi_token_id": vocab_size, "eoi_token_id": vocab_size + 1, "image_token_id": vocab_size + 2}


# The smallest vision tower the config class accepts. DiffusionGemmaConfig always builds one (with
# `vision_config: null` it builds Gemma 4's default tower); no weights ship for it and the engine
# refuses image inputs, so it only keeps a Hugging Face load of the config small.
_PLACEHOLDER_VISION = {
    "attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 16, "initializer_range": 0.02, "intermediate_size": 32, "max_position_embeddings": 131072,
    "model_type": "gemma4_vision", "num_attention_heads": 1, "num_hidden_layers": 1, "num_key_value_heads": 1,
    "patch_size": 4, "pooling_kernel_size": 3, "position_embedding_size": 8, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"}, "standardize": False,
    "use_clipped_linears": False,
}


def diffusion_gemma_config(hidden: int, layer_types: list[str], n_heads: int, kv_heads: int, head_dim: int,
                           full_head_dim: int, full_kv_heads: int, intermediate: int, experts: int,
                           experts_per_token: int, expert_intermediate: int, vocab_size: int, canvas_length: int,
                           sliding_window: int, eos_id: int, pad_id: int, sliding_rope_theta: float,
                           max_len: int = 4096) -> dict[str, Any]:
    """A `DiffusionGemmaConfig` as transformers 5.23 saves it (`save_pretrained`: sorted keys, the full
    layers' shape in `per_layer_config` with string keys, `canvas_length` at the top level), with these
    sizes and ids. The full layers keep the class's RoPE (proportional, a quarter of the pairs, θ 1e6);
    the sliding layers take `sliding_rope_theta`. No bos id: the character tokenizer has none."""
    full = [str(i) for i, kind in enumerate(layer_types) if kind == "full_attention"]
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": eos_id,
        "final_logit_softcapping": 30.0, "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": intermediate,
        "layer_types": list(layer_types), "max_position_embeddings": max_len, "model_type": "diffusion_gemma_text",
        "moe_intermediate_size": expert_intermediate, "num_attention_heads": n_heads, "num_experts": experts,
        "num_hidden_layers": len(layer_types), "num_key_value_heads": kv_heads, "pad_token_id": pad_id,
        "per_layer_config": {i: {"head_dim": full_head_dim, "num_key_value_heads": full_kv_heads} for i in full},
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": sliding_rope_theta, "rope_type": "default"},
        },
        "sliding_window": sliding_window, "tie_word_embeddings": True, "top_k_experts": experts_per_token,
        "use_bidirectional_attention": None, "vocab_size": vocab_size,
    }
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"], **_image_token_ids(vocab_size),
        "canvas_length": canvas_length,
        "dtype": "float32", "initializer_range": 0.02, "model_type": "diffusion_gemma", "text_config": text,
        "tie_word_embeddings": True, "transformers_version": "5.23.0", "vision_config": dict(_PLACEHOLDER_VISION),
    }


def diffusion_gemma_generation_config(eos_id: int, pad_id: int) -> dict[str, Any]:
    """The released checkpoint's `generation_config.json` field set and values (the library's defaults:
    tests/fixtures/diffusion_gemma/README.md, section 2.3), with this tokenizer's end and pad ids. Without
    `eos_token_id` and `pad_token_id` the official loop would not stop at an end token."""
    return {
        "confidence_threshold": 0.005, "eos_token_id": [eos_id], "max_denoising_steps": 48, "max_new_tokens": 256,
        "pad_token_id": pad_id, "return_dict_in_generate": True,
        "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
        "stability_threshold": 1, "t_max": 0.8, "t_min": 0.4, "transformers_version": "5.23.0",
    }


def generation_config(architecture: str, eos_id: int, mask_id: int) -> dict[str, Any]:
    if architecture == "dream":
        return {"_from_model_config": True, "alg": "entropy", "alg_temp": None, "bos_token_id": eos_id,
                "eos_token_id": eos_id, "eps": 0.001, "mask_token_id": mask_id, "pad_token_id": eos_id,
                "steps": 128, "temperature": 0.0, "top_k": None, "top_p": None}
    return {"_from_model_config": True, "eos_token_id": eos_id}


def export_state_dict(model: TrainedModel) -> dict[str, torch.Tensor]:
    """Our parameters under the official checkpoint names (fused q|k|v and gate|up split back)."""
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for hf_name, (param, shard) in expected_weights(model.config).items():
        tensor = params[param].detach()
        if shard is not None:
            start, size = model.get_submodule(param.rsplit(".", 1)[0]).shard_offsets[shard]
            tensor = tensor[start:start + size]
        out[hf_name] = tensor.to(torch.float32).contiguous().clone()
    return out


def save_checkpoint(model: TrainedModel, hf_config: dict[str, Any],
                    gen_config: dict[str, Any], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    save_file(export_state_dict(model), str(dest / "model.safetensors"), metadata={"format": "pt"})
