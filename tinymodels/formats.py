"""Writing checkpoints in the official LLaDA, Dream and SDAR formats (config fields, names, files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.models.transformer import DiffusionTransformer
from engine.models.weight_names import expected_weights


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


def generation_config(architecture: str, eos_id: int, mask_id: int) -> dict[str, Any]:
    if architecture == "dream":
        return {"_from_model_config": True, "alg": "entropy", "alg_temp": None, "bos_token_id": eos_id,
                "eos_token_id": eos_id, "eps": 0.001, "mask_token_id": mask_id, "pad_token_id": eos_id,
                "steps": 128, "temperature": 0.0, "top_k": None, "top_p": None}
    return {"_from_model_config": True, "eos_token_id": eos_id}


def export_state_dict(model: DiffusionTransformer) -> dict[str, torch.Tensor]:
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


def save_checkpoint(model: DiffusionTransformer, hf_config: dict[str, Any],
                    gen_config: dict[str, Any], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    save_file(export_state_dict(model), str(dest / "model.safetensors"), metadata={"format": "pt"})
