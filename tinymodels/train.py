"""Training the built-in tiny models on the task family, on CPU, with LLaDA's objective.

Each example is the problem, chat-templated or plain (as `/v1/completions` sends it, a
`plain_prompt_share` of the examples), followed by a canvas: the reference response, then
end tokens to the end of the canvas (as the Instruct models are trained). A mask ratio
t ~ U(eps, 1) is drawn per example, each canvas position is masked with probability t, and the loss
is the cross-entropy on the masked positions weighted by 1/t (LLaDA's SFT objective), normalised by
`gen_length`. Dream-format models are trained with Dream's shift: the output at position i-1
predicts token i.

Compute goes to the responses, not the fill: a step's examples are sorted by response length and
split into `micro_batches`; each micro-batch gets a canvas as long as its longest response plus a
random amount of fill, and a `full_canvas_share` of them the whole `gen_length` canvas, so the
model still learns what a full canvas of end tokens looks like. Gradients of the micro-batches add
up to one optimizer step.

`--arch sdar` trains a block-diffusion model instead, with the objective of
tinymodels/block_objective.py on the same examples, micro-batches, optimizer and schedule.
`--arch llada2` trains an LLaDA2-format MoE block-diffusion model with the same objective (pieces in
tinymodels/llada2_recipe.py), optionally with LLaDA2.1's editing objective (`edit_noise`).
`--arch diffusion_gemma` trains a uniform-noise block-diffusion model in DiffusionGemma's format
with the objective of tinymodels/dg_objective.py (pieces in tinymodels/dg_recipe.py), on the same
examples, micro-batches and schedule.

Reproducible (seeded; the examples of step s depend only on the seed and s), resumable (a training
state is saved every `checkpoint_every` steps and on interrupt), with a progress bar showing the loss.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.dream import DreamModel
from engine.models.llada import LLaDAModel
from engine.models.llada2 import LLaDA2Model
from engine.models.sdar import SDARModel
from engine.models.transformer import DiffusionTransformer
from engine.special_tokens import SpecialTokens
from tinymodels import char_tokenizer as chars
from tinymodels import dg_recipe, llada2_recipe
from tinymodels.block_objective import block_diffusion_loss, encode_rows
from tinymodels.dg_objective import uniform_noise_loss
from tinymodels.formats import (
    TrainedModel,
    dream_config,
    generation_config,
    llada_config,
    save_checkpoint,
    sdar_config,
)
from tinymodels.optim import Optimizer, build_optimizer, matrix_decay_adamw
from tinymodels.prompt_forms import prompt_text
from tinymodels.tasks import Problem, problems
from tinymodels.train_config import TrainConfig

__all__ = ["TrainConfig", "train"]

_MIN_MASK_RATIO = 1e-3  # LLaDA's eps: t is never 0, so 1/t stays finite
_STATE_FILE = "train_state.pt"


def hf_config_for(config: TrainConfig) -> dict[str, Any]:
    if config.arch == "diffusion_gemma":
        return dg_recipe.hf_config(config)
    if config.arch == "llada2":
        return llada2_recipe.hf_config(config)
    vocab = len(chars.vocabulary())
    mask_id, end_id = chars.special_id(chars.MASK), chars.special_id(chars.END)
    if config.arch == "llada":
        # embedding_size rounded up past the tokenizer's vocabulary, as the real LLaDA does
        return llada_config(config.d_model, config.layers, config.heads, config.mlp_hidden, vocab,
                            embedding_size=-(-vocab // 64) * 64, mask_id=mask_id, eos_id=end_id,
                            rope_theta=config.rope_theta)
    kv_heads = config.kv_heads or max(1, config.heads // 2)
    if config.arch == "sdar":
        return sdar_config(config.d_model, config.layers, config.heads, kv_heads, config.d_model // config.heads,
                           config.mlp_hidden, vocab, mask_id=mask_id, eos_id=end_id, block_size=config.block_size,
                           rope_theta=config.rope_theta)
    return dream_config(config.d_model, config.layers, config.heads, kv_heads,
                        config.mlp_hidden, vocab, mask_id=mask_id, eos_id=end_id, rope_theta=config.rope_theta)


_MODEL_CLASSES: dict[str, type[DiffusionTransformer]] = {"llada": LLaDAModel, "dream": DreamModel, "sdar": SDARModel,
                                                         "llada2": LLaDA2Model}


def build_model(config: TrainConfig) -> tuple[TrainedModel, dict[str, Any]]:
    if config.arch == "diffusion_gemma":
        return dg_recipe.build_model(config)
    hf = hf_config_for(config)
    cls = _MODEL_CLASSES[config.arch]
    end_id = chars.special_id(chars.END)
    special = SpecialTokens(mask_id=chars.special_id(chars.MASK), eos_ids=(end_id,), pad_id=end_id)
    torch.manual_seed(config.seed)
    model = cls(cls.parse_config(hf), special, hf)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(param)
        else:
            torch.nn.init.normal_(param, std=0.02)
        if name.endswith("expert_bias"):  # LLaDA2's routers: moved by llada2_recipe.ExpertLoad, not the gradient
            param.requires_grad_(False)
    return model, hf


def _encode(texts: list[str]) -> list[list[int]]:
    return [e.ids for e in chars.build_tokenizer().encode_batch(texts, add_special_tokens=False)]


def encode_examples(batch: list[Problem], gen_length: int, plain: Optional[list[bool]] = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, P + gen_length] (prompts left-padded), attention mask, and the canvas mask
    (True on the gen_length positions the loss is taken over). `plain[i]`: example i's prompt is the
    bare problem text, not the chat template."""
    end_id = chars.special_id(chars.END)
    plain = plain or [False] * len(batch)
    forms = ["plain" if bare else "chat" for bare in plain]
    prompts = _encode([prompt_text(p.prompt, form) for p, form in zip(batch, forms, strict=True)])
    responses = _encode([p.response for p in batch])
    width = max(len(p) for p in prompts)
    ids = torch.full((len(batch), width + gen_length), end_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        if len(response) >= gen_length:
            raise ValueError(f"response of {len(response)} tokens does not fit a {gen_length}-token canvas")
        ids[i, width - len(prompt):width] = torch.tensor(prompt)
        ids[i, width:width + len(response)] = torch.tensor(response)  # the rest stays end-token fill
        attention[i, width - len(prompt):] = 1
    canvas = torch.zeros_like(ids, dtype=torch.bool)
    canvas[:, width:] = True
    return ids, attention, canvas


def encode_block_examples(batch: list[Problem], plain: list[bool], block_size: int,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diffusion rows [prompt | response | end fill] and their maskable positions
    (tinymodels/block_objective.py); `plain` as in `encode_examples`."""
    forms = ["plain" if bare else "chat" for bare in plain]
    prompts = _encode([prompt_text(p.prompt, form) for p, form in zip(batch, forms, strict=True)])
    return encode_rows(prompts, _encode([p.response for p in batch]), block_size, chars.special_id(chars.END))


def micro_batches(config: TrainConfig, batch: list[Problem],
                  generator: torch.Generator) -> list[tuple[list[Problem], int]]:
    """The step's examples by response length, in `micro_batches` groups, each with its canvas length."""
    lengths = [len(ids) for ids in _encode([p.response for p in batch])]
    order = sorted(range(len(batch)), key=lambda i: lengths[i])
    groups = []
    for part in torch.tensor_split(torch.tensor(order), config.micro_batches):
        rows = part.tolist()
        full = torch.rand(1, generator=generator).item() < config.full_canvas_share
        extra = int(torch.randint(0, config.max_extra_fill + 1, (1,), generator=generator))
        if full and config.long_canvas > config.gen_length:
            canvas = int(torch.randint(config.gen_length, config.long_canvas + 1, (1,), generator=generator))
        elif full:  # no draw: the v2 recipe's random stream, step for step
            canvas = config.gen_length
        else:
            canvas = min(config.gen_length, max(lengths[i] for i in rows) + 1 + extra)
        groups.append(([batch[i] for i in rows], canvas))
    return groups


def masked_diffusion_loss(model: DiffusionTransformer, ids: torch.Tensor, attention: torch.Tensor,
                          canvas: torch.Tensor, generator: torch.Generator, normaliser: int,
                          prefix_mask_share: float = 0.0) -> torch.Tensor:
    """Mean over the batch of the 1/t-weighted masked cross-entropy, divided by `normaliser` (the
    full canvas length, so micro-batches with shorter canvases weigh their tokens the same).

    Randomness comes from the CPU `generator` whatever device the model is on, so a run on a GPU
    sees exactly the masks a CPU run sees."""
    batch, width = ids.shape
    t = _MIN_MASK_RATIO + (1 - _MIN_MASK_RATIO) * torch.rand(batch, 1, generator=generator)
    masked = canvas.cpu() & (torch.rand(ids.shape, generator=generator) < t)
    if prefix_mask_share > 0:
        canvas_start = width - int(canvas[0].sum())
        cut = canvas_start + (torch.rand(batch, 1, generator=generator) * (width - canvas_start)).long()
        prefixed = torch.rand(batch, 1, generator=generator) < prefix_mask_share
        masked &= ~prefixed | (torch.arange(width) >= cut)
    masked, t = masked.to(ids.device), t.to(ids.device)
    noisy = ids.masked_fill(masked, model.special.mask_id)
    logits = model(noisy, attention_mask=attention)
    if model.logits_shifted:  # Dream: output i-1 predicts token i
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    token_loss = F.cross_entropy(logits.float().transpose(1, 2), ids, reduction="none")
    weighted = (token_loss * masked / t).sum(dim=1) / normaliser
    return weighted.mean()


def learning_rate(config: TrainConfig, step: int) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def step_examples(config: TrainConfig, step: int) -> list[Problem]:
    stream = problems(seed=config.seed * 1_000_003 + step, split="train", mix=config.mix)
    return [next(stream) for _ in range(config.batch_size)]


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> Optimizer:
    if isinstance(model, (DiffusionGemmaModel, LLaDA2Model)):
        return matrix_decay_adamw(model, config.lr, config.weight_decay)
    return build_optimizer(model, config.optimizer, config.lr, config.weight_decay)


def train_step(model: torch.nn.Module, optimizer: Optimizer, config: TrainConfig, step: int,
               device: str = "cpu") -> float:
    """One optimizer step on step `step`'s examples; returns its loss."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, step)
    generator = torch.Generator().manual_seed(config.seed * 7919 + step)
    optimizer.zero_grad(set_to_none=True)
    balancing = isinstance(model, LLaDA2Model) and config.router_bias_rate > 0
    load = llada2_recipe.ExpertLoad(model) if balancing else None
    loss = torch.zeros((), device=device)
    for examples, canvas_length in micro_batches(config, step_examples(config, step), generator):
        plain = (torch.rand(len(examples), generator=generator) < config.plain_prompt_share).tolist()
        if isinstance(model, DiffusionGemmaModel):  # rows sized by their own responses, in whole canvases
            rows = dg_recipe.encode_examples(examples, plain, config.canvas_length)
            part = uniform_noise_loss(model, rows.to(device), generator, config.self_conditioning_share,
                                      config.encoder_loss_weight)
        elif model.block_causal:  # rows sized by their own responses, not the canvas
            ids, maskable = encode_block_examples(examples, plain, config.block_size)
            part = block_diffusion_loss(model, ids.to(device), maskable, config.block_size, generator,
                                        config.gen_length, config.edit_noise, llada2_recipe.edit_vocabulary())
        else:
            ids, attention, canvas = encode_examples(examples, canvas_length, plain)
            ids, attention = ids.to(device), attention.to(device)  # masks are drawn on the CPU
            part = masked_diffusion_loss(model, ids, attention, canvas, generator, config.gen_length,
                                         config.prefix_mask_share)
        part = part * len(examples) / config.batch_size
        part.backward()
        loss += part.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if load is not None:
        load.update_biases(config.router_bias_rate)
    return loss.item()


def _export(model: TrainedModel, hf: dict[str, Any], config: TrainConfig, dest: Path) -> None:
    gen = (dg_recipe.generation_config() if config.arch == "diffusion_gemma"
           else generation_config(config.arch, chars.special_id(chars.END), chars.special_id(chars.MASK)))
    save_checkpoint(model, hf, gen, dest)
    chars.write_tokenizer_files(dest)


def snapshot(out: Path, dest: Path) -> dict[str, Any]:
    """Write the model of a run's last saved training state (`out/train_state.pt`) as a checkpoint
    to `dest`, leaving the run untouched: a mid-run look with `cai-dllm eval`. Returns its log."""
    state_path = out / _STATE_FILE
    if not state_path.exists():
        raise FileNotFoundError(f"no training state at {state_path}")
    state = torch.load(state_path, weights_only=False, map_location="cpu")
    config = TrainConfig(**state["log"]["config"])
    model, hf = build_model(config)
    model.load_state_dict(state["model"])
    model.eval()
    _export(model, hf, config, dest)
    # the log goes with it: eval reads the task mix the model is learning from it
    (dest / "training_log.json").write_text(json.dumps(state["log"], indent=1) + "\n")
    return state["log"]


def train(config: TrainConfig, out: Path, resume: bool = False, max_minutes: Optional[float] = None,
          progress: bool = True, stop_at: Optional[int] = None, device: str = "cpu") -> dict[str, Any]:
    """Train, save the checkpoint (official format + tokenizer) to `out`, return the training log.

    `max_minutes` / `stop_at` end the run early (after that long / that many steps) with the
    training state saved, so `resume=True` continues it exactly. `device` only changes where the
    arithmetic runs: the examples and masks of every step are the same on any device."""
    out.mkdir(parents=True, exist_ok=True)
    model, hf = build_model(config)
    model.to(device)
    optimizer = make_optimizer(model, config)
    log: dict[str, Any] = {"config": asdict(config), "losses": [], "seconds": 0.0, "step": 0}
    state_path = out / _STATE_FILE
    if resume and state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location=device)
        if state["log"]["config"] != asdict(config):
            raise ValueError(f"{state_path} was written with another training config; start afresh without --resume")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        log = state["log"]
    elif config.init_from:
        from engine import load_model

        start = load_model(config.init_from)
        if start.config.architecture != config.arch:
            raise ValueError(f"--init-from {config.init_from} is a {start.config.architecture} checkpoint, "
                             f"not {config.arch}")
        model.load_state_dict(start.state_dict())  # raises on any shape that differs
    model.train()
    started = time.perf_counter() - log["seconds"]
    cpu_started = time.process_time() - log.get("cpu_seconds", 0.0)
    bar = tqdm(total=config.steps, initial=log["step"], disable=not progress, desc=f"train {config.arch}",
               dynamic_ncols=True)
    recent: list[float] = log.setdefault("unlogged", [])  # losses since the last logged average

    def save_state() -> None:
        log["seconds"] = time.perf_counter() - started
        log["cpu_seconds"] = time.process_time() - cpu_started  # this process's CPU time, every thread
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "log": log}, state_path)

    try:
        while log["step"] < config.steps:
            step = log["step"]
            out_of_time = max_minutes is not None and time.perf_counter() - started > 60 * max_minutes
            if out_of_time or (stop_at is not None and step >= stop_at):
                break
            recent.append(train_step(model, optimizer, config, step, device))
            log["step"] = step + 1
            if len(recent) == 25 or log["step"] == config.steps:
                log["losses"].append([log["step"], sum(recent) / len(recent)])
                bar.set_postfix(loss=f"{log['losses'][-1][1]:.4f}")
                recent.clear()
            bar.update(1)
            if log["step"] % config.checkpoint_every == 0:
                save_state()
    except KeyboardInterrupt:
        save_state()
        raise
    bar.close()
    save_state()
    model.eval()
    model.to("cpu")
    _export(model, hf, config, out)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log
