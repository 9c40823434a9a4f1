"""Decode prompts with a family's official Hugging Face remote code, as its model card does; run by
`test_builtin_in_official_remote_code.py` under the interpreter of the environment that code needs
(its transformers version), so it imports nothing from the project: torch and transformers only.

`python official_decode.py REQUEST.json` reads `family`, `model_dir` (a checkpoint directory holding the
official .py files beside the weights, its config.json naming them in `auto_map`), `decoder` (the
official decoder's keyword arguments), `prompts` (lists of ids), `greedy` (SDAR only), `seed`
(optional: `torch.manual_seed` before each prompt) and `out`, loads the model with
`from_pretrained(model_dir, trust_remote_code=True)`, calls the family's official decoder once a prompt,
and writes {"transformers": version, "stand_ins": [...], "generated": [ids after the prompt]} to `out`.
The official files run as they are; two things stand in for what a CPU lacks, both named in the
output's `stand_ins`: SDAR's modeling imports the CUDA-only `flash_attn` package at module level,
so where it is not installed a pure-torch `flash_attn` takes its place (the `torch.nn.functional`
attention and the RMSNorm that `modeling_sdar.py` keeps beside its call); and SDAR's block decoder has
no temperature-0 path (it divides by the temperature), so a greedy run takes `torch.multinomial` as
the argmax for the call's duration (the fixture README's section 1.1 does the same).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers


def _module_from(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"official_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     softmax_scale: float | None = None, causal: bool = False, **_: Any) -> torch.Tensor:
    """flash_attn's layout [batch, length, heads, head_dim], grouped KV heads, no dropout at inference."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale,
        enable_gqa=True)
    return out.transpose(1, 2)


def _rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-6,
                 **_: Any) -> torch.Tensor:
    """The RMSNorm `modeling_sdar.py` keeps, commented out, beside its call of this kernel."""
    normed = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if bias is None else normed + bias


def _not_on_cpu(*_: Any, **__: Any) -> None:
    raise NotImplementedError("imported by modeling_sdar.py for training only; never called at inference")


def _install_flash_attn_stand_in() -> bool:
    """Register a pure-torch `flash_attn` when the real package is absent; True when one was installed."""
    if importlib.util.find_spec("flash_attn") is not None:
        return False
    names = {"flash_attn": {"flash_attn_func": _flash_attn_func, "flash_attn_varlen_func": _not_on_cpu},
             "flash_attn.bert_padding": dict.fromkeys(("index_first_axis", "pad_input", "unpad_input"), _not_on_cpu),
             "flash_attn.ops": {}, "flash_attn.ops.triton": {},
             "flash_attn.ops.triton.layer_norm": {"rms_norm_fn": _rms_norm_fn}}
    for name, attributes in names.items():
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers' find_spec reads it
        module.__dict__.update(attributes)
        sys.modules[name] = module
    return True


@contextlib.contextmanager
def _multinomial_as_argmax() -> Iterator[None]:
    original = torch.multinomial
    torch.multinomial = lambda probs, num_samples, **_: probs.argmax(-1, keepdim=True)
    try:
        yield
    finally:
        torch.multinomial = original


def _llada(model_dir: Path, decoder: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(model_dir, trust_remote_code=True, torch_dtype=torch.float32)
    generate = _module_from(model_dir / "generate.py").generate
    return lambda prompt: generate(model.eval(), prompt, **decoder)


def _dream(model_dir: Path, decoder: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(model_dir, trust_remote_code=True, torch_dtype=torch.float32)
    return lambda prompt: model.eval().diffusion_generate(prompt, **decoder)


def _sdar(model_dir: Path, decoder: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True,
                                                              torch_dtype=torch.float32)
    generate = _module_from(model_dir / "generate.py").block_diffusion_generate
    return lambda prompt: generate(model, {"input_ids": prompt}, **decoder)


# family -> (checkpoint directory, the decoder's keyword arguments) -> prompt [1, P] -> ids [1, P + ...]
DECODERS: dict[str, Callable[[Path, dict[str, Any]], Callable[[torch.Tensor], torch.Tensor]]] = {
    "llada": _llada, "dream": _dream, "sdar": _sdar}


def main(request_path: Path) -> None:
    request = json.loads(request_path.read_text())
    family, model_dir = request["family"], Path(request["model_dir"])
    stand_ins = ["flash_attn (pure torch)"] if family == "sdar" and _install_flash_attn_stand_in() else []
    greedy = request.get("greedy", False)
    if greedy:
        stand_ins.append("torch.multinomial -> argmax")
    decode = DECODERS[family](model_dir, request["decoder"])
    generated = []
    with _multinomial_as_argmax() if greedy else contextlib.nullcontext(), torch.no_grad():
        for ids in request["prompts"]:
            if request.get("seed") is not None:
                torch.manual_seed(request["seed"])
            generated.append(decode(torch.tensor([ids]))[0, len(ids):].tolist())
    Path(request["out"]).write_text(json.dumps(
        {"transformers": transformers.__version__, "stand_ins": stand_ins, "generated": generated}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
