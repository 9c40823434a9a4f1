"""Weight-only quantization (engine.quantization): a quantized linear against its float reference, a
quantized fixture model's logits against the official float ones, every decoding path on a
quantized built-in model, the memory estimate against the stored bytes, and refusals at start-up.

Tolerances are relative L2 errors ||quantized - float|| / ||float||, chosen above what the two
libraries give on these tensors (int8 per-row: ~0.5 % on a layer, ~1.5 % on the fixture logits, as
large as bfloat16's own rounding; NF4: ~9 % on a layer, ~17 % on the fixture logits)."""

from __future__ import annotations

import math

import pytest
import torch
from fixture_checkpoints import block_fixture
from safetensors.torch import load_file
from serverproc import MODEL
from torch import nn

from engine import DeviceError, Engine, EngineConfig, load_model
from engine.decoding.params import DEFAULT_BLOCK_LENGTH
from engine.models.moe import SparseMoe
from engine.quantization import (
    check_quantization,
    linear_weight_bytes,
    nf4_fits,
    quantize_linears,
    quantized_model_bytes,
)
from tinymodels.checker import is_correct
from tinymodels.evaluate import held_out_problems, prompt_ids

torchao = pytest.importorskip("torchao", reason="int8/fp8 need torchao (pip install 'cai-dllm[quant]')")
bnb = pytest.importorskip("bitsandbytes", reason="int4 needs bitsandbytes (pip install 'cai-dllm[quant]')")

LAYER_TOLERANCE = {"int8": 0.01, "int4": 0.12}
LOGITS_TOLERANCE = {"int8": 0.03, "int4": 0.25}
# A mixture of experts amplifies a small weight error where it flips a token's top-k expert choice (the
# random tiny LLaDA2 flips 3 of 128 token-layer choices in int8), which moves that token by a whole expert.
MOE_LOGITS_TOLERANCE = {"int8": 0.1, "int4": 0.3}
# A routed expert is a gated MLP: its gate's and up's errors both reach the product (int4 ~13 % on
# the fixture's experts, whose down projection is too narrow for NF4 blocks and stays float).
EXPERT_TOLERANCE = {"int8": 0.02, "int4": 0.2}


def _stored_bytes(linear: nn.Module) -> int:
    weight = linear.weight
    if hasattr(weight, "quant_state"):  # bitsandbytes: packed data, block scales (and their scales)
        state = weight.quant_state
        return weight.data.nbytes + state.absmax.nbytes + (state.state2.absmax.nbytes if state.nested else 0)
    inner, _ = weight.__tensor_flatten__()  # torchao: the int8 data, scales and zero points
    return sum(getattr(weight, name).nbytes for name in inner)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_linear_tracks_its_float_reference(mode, dtype):
    gen = torch.Generator().manual_seed(0)
    reference = nn.Linear(256, 384, bias=True).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(384, 256, generator=gen) * 0.02)
        reference.bias.copy_(torch.randn(384, generator=gen) * 0.02)
    holder = nn.Sequential(nn.Linear(256, 384, bias=True).to(dtype))
    holder[0].load_state_dict(reference.state_dict())
    quantize_linears(holder, mode)
    x = torch.randn(3, 7, 256, generator=gen).to(dtype)
    with torch.no_grad():
        want, got = reference.forward(x).float(), holder[0].forward(x).float()
    assert got.dtype == want.dtype and got.shape == want.shape
    error = ((got - want).norm() / want.norm()).item()
    assert 0 < error < LAYER_TOLERANCE[mode]
    assert _stored_bytes(holder[0]) == linear_weight_bytes(384, 256, mode, dtype, "cpu")
    assert _stored_bytes(holder[0]) < reference.weight.nbytes / (2 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llada", "dream"])
def test_quantized_fixture_logits_track_the_official_float_ones(fixtures, name, mode):
    data = load_file(fixtures / f"{name}_forward.safetensors")
    model = load_model(fixtures / f"{name}_tiny", quantization=mode)
    assert model.quantization == mode and not model.quantized_head
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32  # kept
    with torch.no_grad():
        logits = model(data["input_ids"])
    error = ((logits - data["logits"]).norm() / data["logits"].norm()).item()
    quantized = [m for m in model.layers.modules() if isinstance(m, nn.Linear) and type(m.weight) is not nn.Parameter]
    if mode == "int4" and not quantized:  # no row of this checkpoint's layers is a whole number of NF4 blocks
        assert not any(nf4_fits(m.in_features) for m in model.layers.modules() if isinstance(m, nn.Linear))
        assert error < 1e-4  # the float model's parity with the official logits
        return
    assert quantized and 0 < error < LOGITS_TOLERANCE[mode]


def test_the_head_is_quantized_only_when_asked(fixtures):
    model = load_model(fixtures / "llada_tiny", quantization="int8", quantize_head=True)
    assert model.quantized_head and type(model.lm_head.weight).__name__ != "Parameter"
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_the_memory_estimate_is_what_the_loaded_model_stores(mode):
    model = load_model(MODEL, quantization=mode)
    stored = 0
    for module in model.modules():
        params = dict(module.named_parameters(recurse=False))
        if "weight" in params and module in list(model.layers.modules()) and mode != "none" \
                and isinstance(module, nn.Linear):
            stored += _stored_bytes(module) + sum(p.nbytes for n, p in params.items() if n != "weight")
        else:
            stored += sum(p.nbytes for p in params.values())
    with torch.device("meta"):
        meta = type(model)(model.config, model.special)
    assert stored == quantized_model_bytes(meta, mode, torch.float32, device_type="cpu")


def _decode_held_out(engine: Engine, base, policy_caches, check_answers: bool) -> list[list[int]]:
    """Two held-out problems, batched, through each (policy, cache): tokens, NFE and logprobs that
    agree, and (`check_answers`) the right answers. Returns the prompts."""
    problems = held_out_problems(2, seed=1)
    prompts = [prompt_ids(engine, p, "chat") for p in problems]
    for policy, cache in policy_caches:
        results = engine.generate(prompts, base.with_overrides(policy=policy, cache=cache))
        for problem, result in zip(problems, results, strict=True):
            assert result.generated_ids and result.stats.nfe > 0
            assert [lp.token_id for lp in result.logprobs] == result.generated_ids
            if check_answers:
                assert is_correct(problem.prompt, result.text), (policy, cache, result.text)
    return prompts


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_decoding_path_runs_on_a_quantized_built_in_model(mode):
    """Each policy family and each KV-cache mode (a policy per cache), batched rows, logprobs and
    likelihood scoring; int8 answers the problems the float model answers."""
    engine = Engine(EngineConfig(model=str(MODEL), quantization=mode, max_batch=2))
    assert engine.config.quantization == mode
    base = engine.default_params().with_overrides(gen_length=64, block_length=32, steps=64, logprobs=2)
    prompts = _decode_held_out(engine, base, (("fixed", "none"), ("threshold", "prefix"), ("cai", "dual")),
                               check_answers=mode == "int8")
    values = engine.score(prompts[0], samples=2, seed=0)
    assert len(values) == len(prompts[0]) and all(v is None or math.isfinite(v) for v in values)


def test_fp8_on_cpu_is_refused_naming_mode_and_device():
    with pytest.raises(DeviceError, match=r"fp8.*cpu"):
        check_quantization("fp8", torch.device("cpu"), torch.float32)
    with pytest.raises(DeviceError, match=r"fp8.*cpu"):
        Engine(EngineConfig(model=str(MODEL), quantization="fp8"))


def test_bad_settings_are_refused_before_loading(llada_copy):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int3")
    with pytest.raises(ValueError, match="quantize_head needs"):
        EngineConfig(model="m", quantize_head=True)


@pytest.mark.slow
def test_the_server_answers_on_an_int8_model_and_says_so():
    import httpx
    from serverproc import running_server

    problem = held_out_problems(1, seed=2)[0]
    with running_server("--quantization", "int8") as (base, _proc):
        [card] = httpx.get(f"{base}/v1/models").json()["data"]
        assert card["quantization"] == "int8" and card["quantized_head"] is False
        assert httpx.get(f"{base}/version").json()["quantization"] == "int8"
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": card["id"], "messages": [{"role": "user", "content": problem.prompt}],
            "decoding": {"policy": "cai", "cache": "dual"}})
        assert reply.status_code == 200
        assert is_correct(problem.prompt, reply.json()["choices"][0]["message"]["content"])
        info = [line for line in httpx.get(f"{base}/metrics").text.splitlines()
                if line.startswith("caidllm:engine_config_info{")]
        assert len(info) == 1 and 'quantization="int8"' in info[0] and info[0].endswith(" 1.0")


@pytest.mark.slow
def test_serve_refuses_fp8_on_cpu_at_start_up():
    import subprocess
    import sys

    from serverproc import REPO, free_port

    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--quantization", "fp8",
                           "--port", str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--quantization fp8 is not supported on device cpu" in done.stdout + done.stderr


def test_nf4_in_row_pieces_is_bitsandbytes_one_call_result():
    from engine import quantization

    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 128, generator=gen) * 0.02)
    whole = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="nf4",
                              blocksize=quantization.NF4_BLOCK).to("cpu")
    data, state = quantization._nf4_state(linear.weight.data, 7)  # 14 pieces, the last one short
    assert torch.equal(data, whole.data)
    for name in ("absmax", "offset"):
        assert torch.equal(getattr(state, name), getattr(whole.quant_state, name))
    assert torch.equal(state.state2.absmax, whole.quant_state.state2.absmax)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_models_quantize_their_dense_layers_and_track_float(request, family, mode):
    """SDAR and LLaDA2: every linear layer of the decoder layers is quantized, LLaDA2's routed experts
    too (one linear pair per expert, engine.quantization); logits track the float model's; the
    memory estimate is what the model stores."""
    checkpoint = request.getfixturevalue(f"{family}_dir")
    reference, model = load_model(checkpoint), load_model(checkpoint, quantization=mode)
    float_linears = [name for name, m in model.layers.named_modules() if isinstance(m, nn.Linear)
                     and type(m.weight) is nn.Parameter]
    assert all(mode == "int4" and not nf4_fits(model.layers.get_submodule(name).in_features)
               for name in float_linears), float_linears
    experts = [m.experts for m in model.modules() if isinstance(m, SparseMoe)]
    assert (family == "llada2") == bool(experts)
    for stacked in experts:  # no stacked float weight is left; each expert's gate|up is quantized (NF4: if it fits)
        assert stacked.gate_up_proj is None and stacked.quantized is not None
        assert all((type(pair.gate_up_proj.weight) is not nn.Parameter)
                   == (mode != "int4" or nf4_fits(pair.gate_up_proj.in_features)) for pair in stacked.quantized)
    stored = sum(_stored_bytes(m) if isinstance(m, nn.Linear) and type(m.weight) is not nn.Parameter
                 else sum(p.nbytes for p in m.parameters(recurse=False)) for m in model.modules())
    stored += sum(p.nbytes for m in model.modules() if isinstance(m, nn.Linear) and type(m.weight) is not nn.Parameter
                  for n, p in m.named_parameters(recurse=False) if n != "weight")
    with torch.device("meta"):
        meta = type(model)(model.config, model.special, model.hf_config)
    assert stored == quantized_model_bytes(meta, mode, torch.float32, device_type="cpu")
    block = reference.config.block_size or DEFAULT_BLOCK_LENGTH  # LLaDA2's config names no block
    ids = torch.arange(3, 3 + 2 * block)[None] % reference.config.vocab_size
    with torch.no_grad():
        want, got = reference(ids, block_size=block), model(ids, block_size=block)
    error = ((got - want).norm() / want.norm()).item()
    if not any(isinstance(m, nn.Linear) and type(m.weight) is not nn.Parameter for m in model.modules()):
        assert mode == "int4" and error == 0  # no row of this checkpoint is a whole number of NF4 blocks
        return
    assert 0 < error < (MOE_LOGITS_TOLERANCE if family == "llada2" else LOGITS_TOLERANCE)[mode]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_routed_experts_track_the_float_ones(tmp_path, mode):
    """The fixtures' MoE model (LLaDA2) with its routed experts quantized: each MoE layer's routed
    experts against their float selves, on tokens routed to every expert."""
    checkpoint = block_fixture("llada2", tmp_path)
    reference, model = load_model(checkpoint), load_model(checkpoint, quantization=mode)
    gen = torch.Generator().manual_seed(0)
    pairs = zip((m.experts for m in reference.modules() if isinstance(m, SparseMoe)),
                (m.experts for m in model.modules() if isinstance(m, SparseMoe)), strict=True)
    for want, got in pairs:
        x = torch.randn(64, want.hidden_size, generator=gen)
        ids = torch.randint(0, want.num_experts, (64, 2), generator=gen)
        weights = torch.full((64, 2), 0.5)
        expected, actual = want(x, ids, weights), got(x, ids, weights)
        error = ((actual - expected).norm() / expected.norm()).item()
        # NF4 leaves in float a projection whose rows its blocks would straddle (this fixture's widths)
        if mode == "int4" and not (nf4_fits(want.hidden_size) or nf4_fits(want.intermediate_size)):
            assert error == 0
            continue
        assert 0 < error < EXPERT_TOLERANCE[mode]


def test_int4_keeps_a_layer_whose_rows_nf4_blocks_straddle_in_float():
    """bitsandbytes' packed CPU kernel (eval mode) refuses such a layer; it stays in the model dtype,
    and the memory estimate says so."""
    holder = nn.Sequential(nn.Linear(96, 64, bias=False), nn.Linear(128, 64, bias=False)).eval()
    quantize_linears(holder, "int4")
    assert type(holder[0]) is nn.Linear and type(holder[0].weight) is nn.Parameter
    assert type(holder[1]) is not nn.Linear
    assert linear_weight_bytes(64, 96, "int4", torch.float32, "cpu") == 64 * 96 * 4
    with torch.no_grad():
        assert torch.isfinite(holder[1].forward(holder[0].forward(torch.ones(2, 96)).repeat(1, 2))).all()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_block_policies_run_on_the_quantized_built_in_block_model(mode):
    """sdar-tiny (SDAR format) in int8 and int4: each block policy against the exact cache and without
    it, batched, with logprobs; int8 answers what the float model answers."""
    model = MODEL.parent / "sdar-tiny"
    if not (model / "model.safetensors").is_file():
        pytest.skip("the built-in block model is not committed")
    engine = Engine(EngineConfig(model=str(model), quantization=mode, max_batch=2))
    base = engine.default_params().with_overrides(gen_length=64, steps=64, logprobs=1)
    _decode_held_out(engine, base, (("block-static", "exact"), ("block-dynamic", "none"), ("cai", "exact")),
                     check_answers=mode == "int8")
