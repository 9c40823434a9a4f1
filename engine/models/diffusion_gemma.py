"""DiffusionGemma (`model_type: diffusion_gemma`, `DiffusionGemmaForBlockDiffusion`): uniform-noise
block diffusion on a Gemma4 MoE backbone. No mask token: a canvas of `canvas_length` tokens starts
as random ids and is denoised in place; committed canvases are encoded into the cache.

One set of layers plays two parts (the checkpoint stores the decoder's copy of every shared weight;
only the per-layer `layer_scalar` differs):
- `encode`: the causal encoder over a prompt (prefill) or a committed canvas (commit pass). It
  writes every layer's keys and values into a `Gemma4Cache`; its output is never turned into logits,
  so the last layer stops after its keys and values unless the hidden states are asked for.
- `decode`: the decoder over a canvas, bidirectional inside the canvas, reading the cache (full
  layers: every attendable cached position; sliding layers: the `sliding_window - 1` positions the
  cache retains), never writing it. Input: RMSNorm_noweight(E[canvas]·√hidden + signal), where the
  self-conditioning signal is the gated MLP of the previous step's soft embeddings (zero at a
  canvas's first step, where the MLP of a zero input is exactly zero). Output: float32 logits
  30·tanh(x/30) of the tied head (`final_logit_softcapping`).
Positions continue from each slot's cached length (`Gemma4Cache.length`); a prompt batch may be
left-padded with `attention_mask` as the official processor pads it (pads take positions and cache
columns and are never attended to). The vision tower's weights are recognised and skipped: this
model reads token ids only (image inputs are refused before they reach it).
Attention always runs through SDPA (scale 1.0, windowed masks): the loader's kernel choice is not used.

Tensor parallelism (`tp`): the layers are split as `gemma4_layers` says (query heads, KV heads or
their replicas, the dense MLP, the routed experts), the self-conditioning MLP like a dense MLP, and
each rank's cache holds its KV heads only. The vocabulary is NOT split: the embedding and the tied
head are whole on every rank, which computes the full logits from the same hidden states (no
collective on the logits); the decoder's step needs every logit anyway (it samples, tempers and
soft-embeds the whole vocabulary at every canvas position), and the soft embeddings read the whole
embedding matrix.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.models.attention import AttentionFn
from engine.models.config import ModelConfig
from engine.models.config_parsing import config_errors, hf_sizes, refuse_unsupported
from engine.models.gemma4_cache import CachePass, Gemma4Cache
from engine.models.gemma4_config import FULL, SLIDING, Gemma4Spec, parse_gemma4_spec
from engine.models.gemma4_layers import GeluMlp, Gemma4Layer, Rope
from engine.models.gemma4_ops import KindRotaryEmbedding, rms_norm_unweighted
from engine.models.layers import Float32ScaleRMSNorm
from engine.models.moe import MOE_KERNELS, GroupedExperts
from engine.models.parallel.group import SINGLE, TensorParallel, VocabShard
from engine.models.parallel.sharding import check_divisible
from engine.models.transformer import check_input_ids
from engine.special_tokens import SpecialTokens

# DiffusionGemmaConfig's class defaults, for a config.json that omits the key (transformers 5.23).
_DEFAULT_CANVAS_LENGTH = 256
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = 131_072
_ACTIVATION = "gelu_pytorch_tanh"


class SelfConditioning(nn.Module):
    """RMSNorm_noweight(embeds + down(gelu_tanh(gate n)·up n)) with n = pre_norm(soft embeddings)."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.eps = eps
        self.pre_norm = Float32ScaleRMSNorm(hidden_size, eps)
        self.mlp = GeluMlp(hidden_size, intermediate_size, tp)

    def forward(self, embeds: torch.Tensor, soft: Optional[torch.Tensor]) -> torch.Tensor:
        if soft is not None:
            embeds = embeds + self.mlp.forward(self.pre_norm.forward(soft))
        return rms_norm_unweighted(embeds, self.eps)


class DiffusionGemmaModel(nn.Module):
    architecture: ClassVar[str] = "diffusion_gemma"
    display_name: ClassVar[str] = "DiffusionGemma"
    uses_mask_token: ClassVar[bool] = False  # uniform noise: the canvas starts from random ids

    def __init__(self, config: ModelConfig, special: Optional[SpecialTokens],
                 hf_config: Optional[dict[str, Any]] = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.gemma is None:
            raise ValueError("a DiffusionGemma model needs ModelConfig.gemma")
        check_divisible(config, tp.size)
        self.tp = tp
        self.vocab_start, self.vocab_rows = 0, config.vocab_size  # whole on every rank (module docstring)
        self.config = config
        self.special = special  # None only where a checkpoint's ids are not needed (inspect)
        self.hf_config = dict(hf_config or {})
        self.attention_backend = "sdpa"
        self.quantization = "none"
        self.quantized_head = False
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma4Layer(config, i, tp) for i in range(config.num_layers))
        self.norm = Float32ScaleRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight
        self.self_conditioning = SelfConditioning(config.hidden_size, config.intermediate_size,
                                                  config.rms_norm_eps, tp)
        # no tensors of their own (RotaryEmbedding keeps its frequencies outside the buffers)
        self._rotary = {SLIDING: KindRotaryEmbedding(config.gemma.sliding),
                        FULL: KindRotaryEmbedding(config.gemma.full)}

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> ModelConfig:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError("DiffusionGemma config.json has no text_config object")
        refuse_unsupported("DiffusionGemma", {**hf, **text}, {
            "hidden_activation": text.get("hidden_activation", _ACTIVATION) != _ACTIVATION,
            "attention_bias": bool(text.get("attention_bias")),
            # "all" makes the encoder bidirectional and halves the window; "vision" only concerns images
            "use_bidirectional_attention": text.get("use_bidirectional_attention") == "all",
        })
        if hf.get("tie_word_embeddings", True) is False or text.get("tie_word_embeddings", True) is False:
            raise CheckpointError("DiffusionGemma config field tie_word_embeddings=False (separate encoder, "
                                  "decoder and head weights) is not supported")
        with config_errors("DiffusionGemma"):
            spec = parse_gemma4_spec(text, int(hf.get("canvas_length") or _DEFAULT_CANVAS_LENGTH))
            config = ModelConfig(
                architecture=cls.architecture,
                **hf_sizes(text),
                rms_norm_eps=float(text.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
                rope_theta=spec.sliding.rope_theta,
                qkv_bias=False,
                tie_word_embeddings=True,
                rope_in_float32=False,
                logits_shifted=False,
                max_position_embeddings=int(text.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS)),
                explicit_head_dim=spec.sliding.head_dim,
                qk_norm=True,
                norm_scale_in_float32=True,
                block_size=spec.canvas_length,
                gemma=spec,
            )
        if config.num_heads % spec.full.num_kv_heads:
            raise CheckpointError(f"DiffusionGemma config: {config.num_heads} heads are not divisible by the full "
                                  f"layers' {spec.full.num_kv_heads} KV heads")
        return config

    @property
    def gemma(self) -> Gemma4Spec:
        assert self.config.gemma is not None
        return self.config.gemma

    @property
    def canvas_length(self) -> int:
        return self.gemma.canvas_length

    @property
    def block_size(self) -> Optional[int]:
        return self.gemma.canvas_length

    @property
    def logits_shifted(self) -> bool:
        return False

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def set_attention_kernel(self, name: str, kernel: AttentionFn) -> None:
        """The loader's choice is recorded nowhere: DiffusionGemma attends through SDPA with scale
        1.0 and windowed masks, which the shared kernels do not take."""
        del name, kernel

    def set_moe_kernel(self, name: Optional[str]) -> None:
        """Force the experts' kernel ("plain" or "grouped_mm"); None picks per device."""
        if name is not None and name not in MOE_KERNELS:
            raise ValueError(f"unknown MoE kernel {name!r}; known: {', '.join(MOE_KERNELS)}")
        for layer in self.layers:
            experts: GroupedExperts = layer.experts
            experts.kernel = name

    @contextmanager
    def local_logits(self) -> Iterator[Optional[VocabShard]]:
        """Every rank holds the whole vocabulary (its embedding is the head): the logits are whole."""
        yield None

    def new_cache(self, slots: int, width: int) -> Gemma4Cache:
        """An empty cache for `slots` rows whose full layers hold `width` positions (of this rank's
        KV heads: the layers' own counts, `Gemma4Attention.num_kv_heads`)."""
        gemma = self.gemma
        local = {kind: replace(spec, num_kv_heads=self.tp.kv_split(spec.num_kv_heads)[1])
                 for kind, spec in ((SLIDING, gemma.sliding), (FULL, gemma.full))}
        spec = replace(gemma, sliding=local[SLIDING], full=local[FULL])
        return Gemma4Cache.empty(spec, slots, width, self.dtype, self.device)

    def embed_scale(self) -> torch.Tensor:
        """√hidden as the official float32 buffer, cast to the weight dtype at use (so rounded in bf16):
        a 0-d tensor made on the device, never read back to the host."""
        # full, not tensor: a fill kernel on the device, where tensor() copies a host value and waits
        scale = torch.full((), math.sqrt(self.config.hidden_size), dtype=torch.float32, device=self.device)
        return scale.to(self.dtype)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed.forward(ids) * self.embed_scale()

    def soft_embeddings(self, scaled_logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning input of the next step: softmax(logits / T) (float32, then the weight
        dtype) @ E · √hidden, [B, L, hidden]. The official loop feeds back the temperature-scaled
        logits cast to the embedding dtype; this is what its decoder makes of them."""
        probabilities = scaled_logits.softmax(dim=-1, dtype=torch.float32).to(self.dtype)
        return probabilities @ self.embed.weight * self.embed_scale()

    def _ropes(self, positions: torch.Tensor) -> dict[str, Rope]:
        return {kind: rotary.forward(positions) for kind, rotary in self._rotary.items()}

    def encode(self, input_ids: torch.Tensor, cache: Gemma4Cache, *, rows: Optional[torch.Tensor] = None,
               attention_mask: Optional[torch.Tensor] = None, width: Optional[int] = None,
               hidden_states_out: Optional[list[torch.Tensor]] = None,
               slot_ids: Optional[Sequence[int]] = None, count: Optional[torch.Tensor] = None) -> None:
        """Encode input_ids [B, L] (a prompt, or a committed canvas) at positions length..length+L-1
        of cache rows `rows` (slots 0..B-1 when None) and cache them. `attention_mask` [B, L]: 0 marks a
        pad (left padding). `width` (a host int, >= max(length) + L): the full-layer columns read;
        None reads them all. `hidden_states_out`, when a list, gets every layer's input and the
        final-normed output (Hugging Face's `output_hidden_states` order). `slot_ids`: `rows` as host
        ints, for a cache that keeps its passes (`Gemma4Cache.keep_passes`). `count` [B]: the tokens
        each row encodes, its first ones (None: all), in a static pass (`CachePass`). A long prompt
        may be encoded in consecutive chunks with the same result: no query looks further back than
        the sliding ring and the chunk hold."""
        check_input_ids(input_ids)
        batch, length = input_ids.shape
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids "
                             f"shape {tuple(input_ids.shape)}")
        view = CachePass(cache, batch, length, encoder=True, rows=rows, attendable_new=attention_mask, width=width,
                         slot_ids=slot_ids, count=count)
        ropes = self._ropes(view.positions)
        h = self.embed_tokens(input_ids)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rope = ropes[self.gemma.layer_types[i]]
            if hidden_states_out is not None:
                hidden_states_out.append(h)
            elif i == last:  # no one reads the encoder's output: the last layer only writes its K/V
                layer.write_only(h, rope, view)
                break
            h = layer.forward(h, rope, view)  # no hooks: see engine.models.layers
        view.end_encoder()
        if hidden_states_out is not None:
            hidden_states_out.append(self.norm.forward(h))

    def decode(self, canvas: torch.Tensor, cache: Gemma4Cache, *, rows: Optional[torch.Tensor] = None,
               self_conditioning: Optional[torch.Tensor] = None, width: Optional[int] = None,
               hidden_states_out: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        """Float32 soft-capped logits [B, L, vocab] of canvas [B, L] at positions length..length+L-1
        of cache rows `rows`, against the cache (unchanged). `self_conditioning` [B, L, hidden]: the
        previous step's `soft_embeddings` (None, or zeros for some rows: the first step). `width` and
        `hidden_states_out` as in `encode` (the first entry is the input after self-conditioning)."""
        check_input_ids(canvas)
        batch, length = canvas.shape
        view = CachePass(cache, batch, length, encoder=False, rows=rows, width=width)
        ropes = self._ropes(view.positions)
        h = self.self_conditioning.forward(self.embed_tokens(canvas), self_conditioning)
        for i, layer in enumerate(self.layers):
            if hidden_states_out is not None:
                hidden_states_out.append(h)
            h = layer.forward(h, ropes[self.gemma.layer_types[i]], view)
        h = self.norm.forward(h)
        if hidden_states_out is not None:
            hidden_states_out.append(h)
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.forward(h).float()
        cap = self.gemma.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
