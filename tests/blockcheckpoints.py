"""Small random-weight SDAR and LLaDA2 checkpoints on the built-in character tokenizer, written in
the official formats (`tinymodels.formats`), for serving the block-diffusion families end to end.

Random weights make random text, so two things are built in rather than hoped for: the
residual stream's dimension 0 carries a constant (the embedding sets it, no layer writes to it),
which the head reads as a per-token bias. It keeps the tokenizer's special tokens other than the
end token out of every answer (the server skips special tokens in text, which would make text and
token counts disagree) and gives the end token a bias, so that answers of a few tokens end at it
and longer ones run to their length. What a prompt's answer is, is whatever the engine decodes:
tests compare the server with `Engine.generate` on the same directory."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import DecodeParams, Engine, load_model
from engine.models.block_transformer import BlockDiffusionTransformer
from engine.models.llada2 import LLaDA2Model
from engine.models.sdar import SDARModel
from engine.special_tokens import SpecialTokens
from tinymodels import char_tokenizer as chars
from tinymodels.formats import generation_config, save_checkpoint, sdar_config

SDAR_BLOCK = 8
_BIAS_DIM = 0
_WEIGHT_GAIN = 2.0  # std gain * 1/sqrt(fan_in): large enough that logits are far from ties
_SPECIAL_BIAS = -1000.0  # in units of the bias feature: never the argmax
_END_BIAS = 6.0


def _special() -> SpecialTokens:
    end = chars.special_id(chars.END)
    return SpecialTokens(mask_id=chars.special_id(chars.MASK), eos_ids=(end,), pad_id=end)


def _randomise(model: BlockDiffusionTransformer, seed: int) -> None:
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("expert_bias"):
                param.zero_()
            elif param.dim() == 2:
                std = 1.0 if name == "embed.weight" else _WEIGHT_GAIN / math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            if name.endswith(("o_proj.weight", "down_proj.weight")):  # rows of hidden (stacked per expert)
                param[_BIAS_DIM::hidden] = 0.0
        model.embed.weight[:, _BIAS_DIM] = 1.0
        head = model.lm_head.weight
        head[:, _BIAS_DIM] = 0.0
        end = chars.special_id(chars.END)
        for token in chars.SPECIALS:
            head[chars.special_id(token), _BIAS_DIM] = _END_BIAS if chars.special_id(token) == end else _SPECIAL_BIAS


def _write(model: BlockDiffusionTransformer, hf: dict[str, Any], gen: dict[str, Any], dest: Path) -> Path:
    save_checkpoint(model, hf, gen, dest)
    chars.write_tokenizer_files(dest)
    return dest


def write_sdar(dest: Path, seed: int = 0) -> Path:
    """A 2-layer SDAR (Qwen3 layout, GQA, QK-norm) trained-block 8, in the released config's fields."""
    special = _special()
    hf = sdar_config(hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=128,
                     vocab_size=len(chars.vocabulary()), mask_id=special.mask_id, eos_id=special.eos_id,
                     block_size=SDAR_BLOCK)
    model = SDARModel(SDARModel.parse_config(hf), special, hf)
    _randomise(model, seed)
    return _write(model, hf, generation_config("sdar", special.eos_id, special.mask_id), dest)


def write_llada2(dest: Path, fixture_config: Path, seed: int = 0) -> Path:
    """A random LLaDA2 MoE with the layout of `fixture_config` (the tiny parity fixture's config.json:
    dense first layer, grouped router, shared expert) on the character vocabulary. LLaDA2's config
    has no mask id: it is in generation_config.json, as the loader reads it."""
    special = _special()
    hf = {k: v for k, v in json.loads(fixture_config.read_text()).items() if k != "auto_map"}
    hf.update(vocab_size=len(chars.vocabulary()), pad_token_id=special.pad_id)
    model = LLaDA2Model(LLaDA2Model.parse_config(hf), special, hf)
    _randomise(model, seed)
    gen = {"eos_token_id": special.eos_id, "mask_token_id": special.mask_id}
    return _write(model, hf, gen, dest)


@dataclass(frozen=True)
class Expected:
    """What a server should answer for one choice: the engine's ids cut at max_tokens and the end token."""

    ids: list[int]  # the generated ids a client is told of: the text's, then the end token if it stopped
    text: str
    finish_reason: str


class Oracle:
    """`Engine.generate` on a checkpoint directory, in this process: the answers a server on the same
    directory must give (decoding is deterministic at temperature 0)."""

    def __init__(self, model_dir: Path, block_length: int) -> None:
        self.engine = Engine.from_model(load_model(model_dir), max_batch=4)
        self.tokenizer = chars.build_tokenizer()
        self.block_length = block_length
        self.end_id = chars.special_id(chars.END)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def answer(self, prompt: str, max_tokens: int, **knobs: Any) -> Expected:
        block = knobs.pop("block_length", self.block_length)
        params = DecodeParams(gen_length=-(-max_tokens // block) * block, block_length=block, **knobs)
        ids = self.engine.generate([self.encode(prompt)], params)[0].generated_ids[:max_tokens]
        if not params.ignore_eos and self.end_id in ids:
            ids = ids[:ids.index(self.end_id) + 1]
            return Expected(ids, self.tokenizer.decode(ids[:-1]), "stop")
        return Expected(ids, self.tokenizer.decode(ids), "length")
