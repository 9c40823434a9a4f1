"""bench/gpu_step.py: it runs end to end at tiny shapes on CPU, and its FLOP and byte counts match
a case counted by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from engine.models.dream import DreamModel
from engine.models.llada import LLaDAModel
from engine.models.registry import model_class_for
from engine.special_tokens import SpecialTokens

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    spec = importlib.util.spec_from_file_location("gpu_step", ROOT / "bench" / "gpu_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_step"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_step = _load_bench()
block_step = sys.modules["block_step"]  # imported by gpu_step from bench/

# hidden 8, 1 layer, 2 heads of 4, SwiGLU 16, vocabulary 32.
# LLaDA, untied, no biases: qkv 8*24 + o 8*8 + gate|up 8*32 + down 16*8 + 2 norms 8 = 656 a layer, + final
# norm 8 = 664; k and v projections 2 * 8*8 = 128.
LLADA_DIMS = gpu_step.ModelDims(body_params=664, head_params=32 * 8, hidden_size=8, q_size=8, kv_size=8,
                                num_layers=1, shift=0, elem_bytes=4, layer_params=656, kv_proj_params=128)
# Dream, 1 KV head of 4 (GQA), q/k/v biases: qkv 8*16 + 16 + o 64 + mlp 384 + norms 16 = 608 a layer, + final
# norm 8 = 616; k and v projections 2 * (8*4 + 4) = 72.
DREAM_DIMS = gpu_step.ModelDims(body_params=616, head_params=32 * 8, hidden_size=8, q_size=8, kv_size=4,
                                num_layers=1, shift=1, elem_bytes=2, layer_params=608, kv_proj_params=72)


def _tiny_model(cls, hf: dict):
    special = SpecialTokens(mask_id=31, eos_ids=(30,), pad_id=30)
    return cls(cls.parse_config(hf), special, hf).to(torch.bfloat16 if cls is DreamModel else torch.float32)


def test_model_dims_count_parameters_as_by_hand():
    llada = _tiny_model(LLaDAModel, {
        "d_model": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden_size": 16, "vocab_size": 32,
        "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True})
    dream = _tiny_model(DreamModel, {
        "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 16, "vocab_size": 32})
    assert gpu_step.ModelDims.of(llada) == LLADA_DIMS
    assert gpu_step.ModelDims.of(dream) == DREAM_DIMS


def test_real_shapes_have_the_released_parameter_count(fixtures: Path):
    # Built on the meta device: no memory. The index files give the bf16 checkpoints' total size.
    for name in gpu_step.MODELS:
        spec = gpu_step.model_spec(name, "real", fixtures / "real")
        cls = model_class_for(spec.hf_config)
        with torch.device("meta"):
            model = cls(cls.parse_config(spec.hf_config), spec.checkpoint.special_tokens(), spec.hf_config)
        dims = gpu_step.ModelDims.of(model.to(torch.bfloat16))
        index = json.loads((spec.checkpoint.path / "model.safetensors.index.json").read_text())
        embed = model.embed.weight.numel()
        assert (dims.body_params + dims.head_params + embed) * 2 == index["metadata"]["total_size"]


def test_flops_and_bytes_by_hand():
    # prompt 8 + gen 8 (canvas 16), block 4, first block (starts at 8), batch 2, LLaDA.
    def shape(cache, kind, dims=LLADA_DIMS, batch=2):
        return gpu_step.step_shape(dims, batch, cache, kind, prompt_len=8, gen_len=8, block=4, block_start=8)

    full = shape("none", "full")
    assert (full.fed_tokens, full.keys, full.logits, full.kv_read) == (32, 16, 4, 0)
    # The one layer is the last: every fed token (32) through its k/v projections and nothing else,
    # the rest of it (656 - 128), the final norm (8) and the head (256) at the 8 logit positions only:
    # 2*128*32 + 2*(528 + 8 + 256)*8; attention: 4 * 8 queries (the logit positions) * 16 keys * 8 wide
    assert gpu_step.step_flops(LLADA_DIMS, full) == 8192 + 12672 + 4096
    # (body + head + 32 looked-up embedding rows of 8) * 4 bytes; no cache
    assert gpu_step.step_bytes(LLADA_DIMS, full) == (664 + 256 + 256) * 4

    dual = shape("dual", "cached")
    assert dual.fed_tokens == 8
    # every fed position is a logit position: the whole body and head at 8 tokens
    assert gpu_step.step_flops(LLADA_DIMS, dual) == 2 * 664 * 8 + 4096 + 4 * 8 * 16 * 8
    # + keys and values of 16 columns x 2 rows x 8 wide x 1 layer x 4 bytes
    assert gpu_step.step_bytes(LLADA_DIMS, dual) == (664 + 256 + 8 * 8) * 4 + 2 * 2 * 16 * 8 * 4

    assert shape("prefix", "cached").fed_tokens == 2 * 8  # block start to the end of the canvas
    assert shape("prefix", "full").fed_tokens == shape("dual", "full").fed_tokens == 32
    with pytest.raises(ValueError):
        shape("none", "cached")

    # Dream feeds the position before the block too: 4 + 1 tokens, still 4 logit positions.
    dream_dual = shape("dual", "cached", DREAM_DIMS, batch=1)
    assert dream_dual.fed_tokens == 5
    assert shape("prefix", "cached", DREAM_DIMS, batch=1).fed_tokens == 9
    # the position before the block is fed for its keys and values (72 params) but is no logit position
    assert gpu_step.step_flops(DREAM_DIMS, dream_dual) == 2 * 72 * 5 + 2 * (616 - 72 + 256) * 4 + 4 * 4 * 16 * 8
    assert gpu_step.step_bytes(DREAM_DIMS, dream_dual) == (616 + 256 + 5 * 8) * 2 + 2 * 16 * 4 * 2


def test_prompt_ids_stay_below_every_special_and_added_id(fixtures: Path):
    for name in gpu_step.MODELS:
        spec = gpu_step.model_spec(name, "tiny", fixtures / "real")
        special = spec.checkpoint.special_tokens()
        assert spec.token_limit <= min(special.mask_id, special.pad_id, *special.eos_ids)
        prompts = gpu_step.random_prompts(2, 64, spec.token_limit, seed=0)
        assert max(max(p) for p in prompts) < spec.token_limit


def test_tiny_cpu_run_prints_every_row(capsys, fixtures: Path):
    gpu_step.main(["--real-dir", str(fixtures / "real"), "--shapes", "tiny", "--device", "cpu",
                   "--dtype", "float32", "--prompt-len", "16", "--gen-len", "32", "--block", "8",
                   "--models", "llada", "dream", "--batches", "1", "2", "--repeats", "2",
                   "--cached-steps", "2", "--copy-mib", "16", "--matmul-n", "256",
                   # one thread: a shared CI core is not slowed tenfold by threads waiting on each other
                   "--threads", "1"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("# command: python bench/gpu_step.py --real-dir ")
    assert any("sdpa only" in line for line in lines if line.startswith("# device:"))
    assert not [line for line in lines if "warning" in line]
    header, *rows = [line.split() for line in lines if not line.startswith("#")]
    assert tuple(header) == gpu_step.COLUMNS
    seen = set()
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        key = (cells["model"], int(cells["batch"]), cells["cache"], cells["step"])
        assert key not in seen
        seen.add(key)
        for column in ("step_ms", "tok_per_s", "mem_floor_ms", "comp_floor_ms", "floor_ms", "step/floor"):
            value = float(cells[column])
            assert math.isfinite(value) and value > 0, (key, column, value)
        fed = int(cells["fed_tok"])
        shift = 1 if cells["model"] == "dream" else 0
        batch = int(cells["batch"])
        expected = {"full": 48, "dual": 8 + shift, "prefix": 32 + shift}
        assert fed == batch * expected["full" if cells["step"] == "full" else cells["cache"]], key
    want = {(m, b, c, k) for m in ("llada", "dream") for b in (1, 2)
            for c, kinds in (("none", ("full",)), ("prefix", ("full", "cached")), ("dual", ("full", "cached")))
            for k in kinds}
    assert seen == want


def test_quantization_switch_runs_each_mode_and_lowers_the_memory_floor(capsys, fixtures: Path):
    pytest.importorskip("torchao", reason="int8 needs torchao (pip install 'cai-dllm[quant]')")
    pytest.importorskip("bitsandbytes", reason="int4 needs bitsandbytes (pip install 'cai-dllm[quant]')")
    gpu_step.main(["--real-dir", str(fixtures / "real"), "--shapes", "tiny", "--device", "cpu", "--models", "llada",
                   "--dtype", "float32", "--prompt-len", "16", "--gen-len", "16", "--block", "8",
                   "--batches", "1", "--caches", "dual", "--repeats", "1", "--cached-steps", "1",
                   "--copy-mib", "16", "--matmul-n", "128", "--threads", "1",
                   "--quantization", "none", "int8", "int4"])
    header, *rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    floors = {}
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        floors.setdefault(cells["step"], {})[cells["quant"]] = float(cells["mem_floor_ms"])
    for by_mode in floors.values():  # (the tiny fixture's layers narrower than an NF4 block stay in
        # float in int4, so int4 against int8 depends on the shapes)
        assert by_mode["int4"] < by_mode["none"] and by_mode["int8"] < by_mode["none"]


# ------------------------------------------------------------------------------ block-diffusion models

# LLaDA2 by hand: hidden 8, 2 layers (the first dense), 2 query heads and 1 KV head of 4, dense SwiGLU 16,
# 4 routed experts (top 2, 2 groups, 1 group kept) and 1 shared expert of 4, vocabulary 32, QK-norm, fp32.
# Attention 8*16 + 8*8 + norms 4+4+8+8 = 216 a layer. Layer 0: + gate|up 8*32 + down 16*8 = 600.
# Layer 1: + router 4*8 + bias 4 + 4 experts * 3*8*4 + shared 3*8*4 = 732. Final norm 8: body 1340.
# A token skips 2 experts of 96: it runs 1340 - 192 = 1148 body params, 540 of the last layer.
LLADA2_TINY = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 4, "intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
               "topk_group": 1, "moe_intermediate_size": 4, "num_shared_experts": 1, "first_k_dense_replace": 1,
               "vocab_size": 32}


def _tiny_llada2(fixtures: Path):
    from engine.models.llada2 import LLaDA2Model

    [config] = sorted((fixtures / "block" / "llada2").glob("*/config.json"))  # its field set, these sizes
    hf = {**json.loads(config.read_text()), **LLADA2_TINY}
    return LLaDA2Model(LLaDA2Model.parse_config(hf), SpecialTokens(mask_id=31, eos_ids=(30,), pad_id=30), hf)


def test_block_dims_count_the_experts_a_token_runs_and_the_step_touched(fixtures: Path):
    model = _tiny_llada2(fixtures)
    full = gpu_step.ModelDims.of(model)
    assert (full.body_params, full.layer_params, full.kv_proj_params) == (1340, 732, 64)
    dims = block_step.block_dims(model, experts_touched=3)
    assert (dims.body_params, dims.layer_params) == (1148, 540)
    assert dims.body_bytes == (1340 - 4 * 96 + 3 * 96) * 4  # dense and shared weights, 3 routed experts


def test_block_step_flops_and_bytes_by_hand(fixtures: Path):
    dims = block_step.block_dims(_tiny_llada2(fixtures), experts_touched=3)
    # prompt 8 (two blocks of 4), batch 2
    prefill, denoise, next_ = (block_step.block_step_shape(kind, 2, prompt_len=8, block=4)
                               for kind in (block_step.PREFILL, block_step.DENOISE, block_step.NEXT))
    assert (prefill.start, prefill.fed, denoise.start, denoise.fed, next_.start, next_.fed) == (0, 12, 8, 4, 8, 8)
    # block-causal: positions of block j see 4 (j + 1) keys
    assert prefill.keys_seen(range(12)) == 4 * 4 + 4 * 8 + 4 * 12
    assert next_.keys_seen(range(8, 16)) == 4 * 12 + 4 * 16
    # denoise: every fed position is a logit position. 2 rows x 2 x (1148 - 484 fed-only + 484 + 256 head) x 4,
    # 484 = the last layer's 540 - 64 k/v projection params + the final norm's 8; attention 4 x 2 x 8 wide x
    # (1 layer x 48 keys + 48 keys)
    assert block_step.block_step_flops(dims, denoise) == 2 * 2 * (664 * 4 + 740 * 4) + 4 * 2 * 8 * (48 + 48)
    # the weights read, 8 embedding rows of 8, and 8 cached columns x 2 rows x (k, v) x 4 wide x 2 layers
    assert block_step.block_step_bytes(dims, denoise) == (1244 + 256 + 8 * 8) * 4 + 8 * 2 * 2 * 4 * 2 * 4


def test_block_real_shapes_have_the_released_sizes(fixtures: Path):
    sizes = {}
    for name in block_step.BLOCK_MODELS:
        spec = block_step.block_spec(name, "real", fixtures / "real")
        cls = model_class_for(spec.hf_config)
        with torch.device("meta"):
            model = cls(cls.parse_config(spec.hf_config), spec.special, spec.hf_config).to(torch.bfloat16)
        sizes[name] = sum(p.numel() for p in model.parameters())
        assert spec.token_limit <= min(spec.special.mask_id, *spec.special.eos_ids)
        if name == "llada2":
            c = model.config  # 20 layers, the first dense; 256 experts of 3 x 2048 x 512, one shared
            attention = 2048 * (16 + 2 * 4) * 128 + 16 * 128 * 2048 + 2 * 128 + 2 * 2048
            moe = 256 * 2048 + 256 + 257 * 3 * 2048 * 512
            assert (c.num_layers, c.moe.num_experts, c.vocab_size) == (20, 256, 157184)
            assert sizes[name] == 20 * attention + 3 * 2048 * 5120 + 19 * moe + 2048 + 2 * 157184 * 2048
    index = json.loads((fixtures / "real" / "sdar-8b-chat" / "model.safetensors.index.json").read_text())
    assert sizes["sdar"] * 2 == index["metadata"]["total_size"]


def test_tiny_cpu_run_prints_the_block_rows(capsys, fixtures: Path):
    gpu_step.main(["--real-dir", str(fixtures / "real"), "--shapes", "tiny", "--device", "cpu",
                   "--dtype", "float32", "--prompt-len", "16", "--block", "8", "--models", "sdar", "llada2",
                   "--batches", "1", "2", "--repeats", "1", "--cached-steps", "2", "--copy-mib", "16",
                   "--matmul-n", "256", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if "warning" in line]  # the engine fed what the floor counts
    touched = [line for line in lines if "routed experts touched per MoE layer" in line]
    assert len(touched) == 2 * 3 and not [line for line in lines if line.startswith("# sdar batch")]
    fed_per_row = {"prefill": 16 + 8, "denoise": 8, "next": 2 * 8}
    seen = _exact_cache_rows(lines, fed_per_row)
    assert seen == {(m, b, k) for m in ("sdar", "llada2") for b in (1, 2) for k in fed_per_row}


# ------------------------------------------------------------------------------ DiffusionGemma

dg_step = sys.modules["dg_step"]


def test_dg_real_shapes_are_the_published_26b_a4b(tmp_path: Path):
    """bench/dg_step.py's REAL_CONFIG as `cai-dllm inspect` reads it: the published 25.2B parameters,
    3.8B active (its model card's figures, rounded), and the 5:1 layer pattern."""
    from engine.inspect import describe_checkpoint

    (tmp_path / "config.json").write_text(json.dumps(dg_step.REAL_CONFIG))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(dg_step.SPECIAL.eos_ids),
                                                                 "pad_token_id": dg_step.SPECIAL.pad_id}))
    report = describe_checkpoint(tmp_path)
    assert abs(report["parameters"] - 25.2e9) < 0.1e9 and abs(report["active_parameters"] - 3.8e9) < 0.1e9
    assert report["layer_pattern"].startswith("SSSSSF x5") and report["canvas_length"] == 256
    # keys and values of 5 full layers x 2 KV heads x 512, bf16, per cached position
    assert report["kv_cache"].startswith(f"{5 * 2 * 2 * 512 * 2 / 1e3:.1f} kB per cached position")
    assert report["weights"]["status"].startswith("not loadable")


def test_dg_step_flops_and_bytes_by_hand():
    # 1 layer of each kind would hide the sliding cap: use the tiny dims, then count one denoise step by hand
    dims = dg_step.DgDims(vocab=32, hidden=8, heads=2, elem_bytes=2, layers=(("sliding_attention", 1, 4),
                          ("full_attention", 1, 8)), retained=3, window=4, layer_dense=100, expert=10,
                          experts_per_token=2, self_conditioning=20)
    denoise = dg_step.dg_step_shape(dg_step.DENOISE, batch=1, prompt_len=6, canvas=4)
    # tokens 4 x 2 x (100 + 2 x 10) + head 2 x 2 x 32 x 8 x 4 + sc 2 x 20 x 4 + attention 4 x 2 heads x
    # (4 wide x 4 queries x (3 retained + 4) + 8 wide x 4 x (6 + 4))
    assert dg_step.dg_step_flops(dims, denoise) == 960 + 4096 + 160 + 4 * 2 * (4 * 4 * 7 + 8 * 4 * 10)
    # weights 100 + 5 touched experts x 10 + sc 20 + head twice 2 x 256 + 4 rows of 8; kv (k, v) x (3 x 4 + 6 x 8)
    assert dg_step.dg_step_bytes(dims, denoise, 5) == (100 + 50 + 20 + 512 + 32 + 2 * (12 + 48)) * 2
    next_ = dg_step.dg_step_shape(dg_step.NEXT, batch=1, prompt_len=6, canvas=4)
    assert (next_.cached, next_.encoded, next_.fed) == (6, 4, 8)
    # causal queries 7..10 see min(cached + i + 1, window 4) sliding keys, cached + i + 1 full keys
    assert dg_step._encoder_keys("sliding_attention", dims, 6, 4) == 16
    assert dg_step._encoder_keys("full_attention", dims, 6, 4) == 7 + 8 + 9 + 10


def test_tiny_cpu_run_prints_the_dg_rows(capsys):
    gpu_step.main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "16",
                   "--models", "dg", "--batches", "1", "2", "--repeats", "1", "--cached-steps", "1",
                   "--copy-mib", "16", "--matmul-n", "128", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if "warning" in line]  # the engine fed what the floor counts
    assert len([line for line in lines if "routed experts touched per layer and pass" in line]) == 2 * 3
    canvas = dg_step.TINY_CANVAS
    fed_per_row = {"prefill": 16 + canvas, "denoise": canvas, "next": 2 * canvas}
    seen = _exact_cache_rows(lines, fed_per_row)
    assert seen == {("dg", b, k) for b in (1, 2) for k in fed_per_row}


def test_tensor_parallel_rows_run_at_tiny_shapes(capsys, fixtures: Path):
    """`-tp 2` on CPU (bench/tp_step.py): every row of a masked and a block family at TP2 beside TP1,
    with the bytes a step moved."""
    gpu_step.main(["--real-dir", str(fixtures / "real"), "-tp", "2", "--shapes", "tiny", "--device", "cpu",
                   "--dtype", "float32", "--models", "llada", "sdar", "--prompt-len", "16", "--gen-len", "16",
                   "--block", "8", "--batches", "1", "--caches", "dual", "--repeats", "1", "--cached-steps", "1",
                   "--copy-mib", "16", "--matmul-n", "128", "--threads", "1"])
    header, *rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    cells = [dict(zip(header, row, strict=True)) for row in rows]
    assert {(c["model"], c["tp"]) for c in cells} == {(m, tp) for m in ("llada", "sdar") for tp in ("1", "2")}
    assert all(math.isfinite(float(c["step_ms"])) and float(c["step_ms"]) > 0 for c in cells)
    # what rank 0 received a step: nothing on one device, the layers' all-reduces and the decide's few numbers at TP2
    assert all((float(c["wire_kb"]) > 0) == (c["tp"] == "2") for c in cells)


def _exact_cache_rows(lines: list[str], fed_per_row: dict[str, int]) -> set[tuple[str, int, str]]:
    """The (model, batch, step) of every row printed, each checked: exact cache, the tokens fed that
    its step feeds a row at its batch, finite positive times and floors."""
    header, *rows = [line.split() for line in lines if not line.startswith("#")]
    seen = set()
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        key = (cells["model"], int(cells["batch"]), cells["step"])
        seen.add(key)
        assert cells["cache"] == "exact" and int(cells["fed_tok"]) == key[1] * fed_per_row[key[2]], key
        for column in ("step_ms", "tok_per_s", "mem_floor_ms", "comp_floor_ms", "floor_ms", "step/floor"):
            assert math.isfinite(float(cells[column])) and float(cells[column]) > 0, (key, column)
    return seen
