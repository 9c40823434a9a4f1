"""Our SDAR and LLaDA2 forward passes against the official code's outputs (float32, CPU): the full
block-causal forward, the incremental path over an exact K/V cache, and LLaDA2.1's additive 0/1
mask. Every size, id, block size and prompt comes from the files under `block/` of the fixtures
directory, so the tests run unchanged on another fixture set of the same layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from engine.models.block_transformer import BlockCache, BlockDiffusionTransformer, block_causal_mask
from engine.models.kv_cache import KVStore
from engine.models.moe import GroupedExperts, grouped_mm_available

LOGITS_ATOL = 1e-4  # the fixture READMEs' tolerance (logit std ≈ 5-12)
STATE_ATOL = 1e-5  # hidden states, keys and values, router outputs
MOE_KERNELS = ["plain", "grouped_mm", "dense"] if grouped_mm_available() else ["plain", "dense"]


def _close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)


def _store(model: BlockDiffusionTransformer, rows: int, width: int) -> KVStore:
    config = model.config
    return KVStore.empty(config.num_layers, rows, config.num_kv_heads, width, config.head_dim, model.dtype,
                         model.device)


def _at(rows: int, start: int) -> torch.Tensor:
    return torch.full((rows,), start, dtype=torch.long)


@pytest.fixture(scope="module")
def sdar_dir(fixtures) -> Path:
    return fixtures / "block" / "sdar"


@pytest.fixture(scope="module")
def llada2_dir(fixtures) -> Path:
    return fixtures / "block" / "llada2"


def _sdar_checkpoint_for(sdar_dir: Path, block_size: int) -> Path:
    """The fixture checkpoint trained with this block size (each block size is its own model)."""
    found = [p.parent for p in sorted(sdar_dir.glob("*/config.json"))
             if json.loads(p.read_text()).get("block_size") == block_size]
    assert len(found) == 1, f"expected one SDAR checkpoint with block_size {block_size}, found {found}"
    return found[0]


def _block_size_of(mask_row: torch.Tensor, allowed_value: float) -> int:
    """A block-causal mask's first query row allows exactly the first block."""
    return int((mask_row == allowed_value).sum())


def _forward_files(sdar_dir: Path, kind: str) -> list[Path]:
    files = sorted(sdar_dir.glob(f"*_{kind}.safetensors"))
    assert files, f"no *_{kind}.safetensors in {sdar_dir}"
    return files


@pytest.fixture(scope="module")
def llada2_checkpoint(llada2_dir, tmp_path_factory) -> Path:
    """The tiny LLaDA2 checkpoint. Its config.json names no mask or eos id (the official `generate()`
    takes them as arguments); they come from the golden runs' settings and, eos = pad, its config."""
    source = next(p.parent for p in sorted(llada2_dir.glob("*/config.json")))
    config = json.loads((source / "config.json").read_text())
    mask_ids = {json.loads(p.read_text())["settings"]["mask_id"] for p in sorted(llada2_dir.glob("golden/*.json"))}
    assert len(mask_ids) == 1, mask_ids
    config.update(mask_token_id=mask_ids.pop(), eos_token_id=config["pad_token_id"])
    dest = tmp_path_factory.mktemp("llada2")
    (dest / "config.json").write_text(json.dumps(config))
    for weights in source.glob("*.safetensors"):
        (dest / weights.name).symlink_to(weights)
    return dest


@pytest.fixture(scope="module")
def llada2_model(llada2_checkpoint) -> BlockDiffusionTransformer:
    return load_model(llada2_checkpoint)


@pytest.fixture(scope="module")
def llada2_data(llada2_dir) -> dict[str, torch.Tensor]:
    return load_file(next(iter(sorted(llada2_dir.glob("*_forward.safetensors")))))


def _llada2_block_size(data: dict[str, torch.Tensor]) -> int:
    return _block_size_of(data["attention_mask_block"][0, 0, 0], 0.0)  # additive: 0 = allowed


# ---- SDAR ----------------------------------------------------------------------------------------

def test_sdar_full_block_causal_forward_matches_official(sdar_dir):
    for path in _forward_files(sdar_dir, "forward"):
        data = load_file(path)
        block = _block_size_of(data["attention_mask"][0, 0], 1.0)
        model = load_model(_sdar_checkpoint_for(sdar_dir, block))
        positions = data["position_ids"]
        # our block-causal mask is exactly the one the official decoders build
        assert torch.equal(block_causal_mask(positions, positions, block)[:, 0], data["attention_mask"].bool())
        hidden: list[torch.Tensor] = []
        with torch.no_grad():
            logits = model(data["input_ids"], positions, block_size=block, hidden_states_out=hidden)
            # the negative controls are the two limits of the block size: one token and the whole row
            token_causal = model(data["input_ids"], positions, block_size=1)
            bidirectional = model(data["input_ids"], positions, block_size=data["input_ids"].shape[1])
        _close(logits, data["logits"], LOGITS_ATOL)
        assert len(hidden) == data["hidden_states"].shape[0]
        for ours, ref in zip(hidden, data["hidden_states"], strict=True):
            _close(ours, ref, LOGITS_ATOL)
        _close(token_causal, data["logits_token_causal_mask"], LOGITS_ATOL)
        _close(bidirectional, data["logits_all_ones_mask"], LOGITS_ATOL)


def test_sdar_incremental_path_matches_official(sdar_dir):
    """Prefill, two denoising steps of block A, its store pass, block B's first step: the calls
    the official decoder makes, each against the cache the previous ones left."""
    for path in _forward_files(sdar_dir, "incremental"):
        data = load_file(path)
        prompt = data["prompt_ids"]
        rows, prompt_len = prompt.shape
        block = data["blockA_ids_step0"].shape[1]
        model = load_model(_sdar_checkpoint_for(sdar_dir, block))
        assert torch.equal(data["prefill_position_ids"][0], torch.arange(prompt_len))
        assert torch.equal(data["blockA_position_ids"][0], prompt_len + torch.arange(block))
        assert torch.equal(data["blockB_position_ids"][0], prompt_len + block + torch.arange(block))
        store = _store(model, rows, prompt_len + 2 * block)
        layers = range(model.config.num_layers)


        def cached(ids: torch.Tensor, start: int, model=model, store=store, block=block) -> torch.Tensor:
            with torch.no_grad():
                cache = BlockCache(store, _at(ids.shape[0], start), width=start + ids.shape[1])
                return model.forward_cached(ids, cache, block_size=block)

        _close(cached(prompt, 0), data["prefill_logits"], LOGITS_ATOL)
        for i in layers:
            _close(store.keys[i][:, :, :prompt_len], data["cache_k_after_prefill"][i], STATE_ATOL)
            _close(store.values[i][:, :, :prompt_len], data["cache_v_after_prefill"][i], STATE_ATOL)
        _close(cached(data["blockA_ids_step0"], prompt_len), data["blockA_logits_step0"], LOGITS_ATOL)
        _close(cached(data["blockA_ids_step1"], prompt_len), data["blockA_logits_step1"], LOGITS_ATOL)
        for i in layers:  # denoising steps leave the cached prefix alone
            _close(store.keys[i][:, :, :prompt_len], data["cache_k_after_prefill"][i], STATE_ATOL)
        _close(cached(data["blockA_ids_clean"], prompt_len), data["blockA_logits_store_kv_pass"], LOGITS_ATOL)
        for i in layers:
            _close(store.keys[i][:, :, :prompt_len + block], data["cache_k_after_blockA"][i], STATE_ATOL)
            _close(store.values[i][:, :, :prompt_len + block], data["cache_v_after_blockA"][i], STATE_ATOL)
        block_b = cached(data["blockB_ids_step0"], prompt_len + block)
        _close(block_b, data["blockB_logits_step0"], LOGITS_ATOL)
        with torch.no_grad():
            full = model(data["full_equiv_input_ids"], block_size=block)
        _close(full, data["full_equiv_logits"], LOGITS_ATOL)
        _close(block_b, full[:, prompt_len + block:], LOGITS_ATOL)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_rows_at_different_blocks_share_one_cached_forward(sdar_dir, packed):
    """A batch of rows at different blocks feeding different numbers of tokens (one its first two
    blocks against an empty cache, one its last block against the cache of the others) in one
    forward over the store's rows in place, padded or packed (engine/models/packing.py): every row
    gets its own full block-causal forward's logits, and the padding leaves the cache alone."""
    data = load_file(_forward_files(sdar_dir, "forward")[0])
    block = _block_size_of(data["attention_mask"][0, 0], 1.0)
    model = load_model(_sdar_checkpoint_for(sdar_dir, block))
    ids = data["input_ids"][0]
    blocks = ids.shape[0] // block
    assert blocks >= 3, "the fixture row must hold at least three blocks"
    scratch = ids.shape[0]
    store = _store(model, 2, scratch + 1)
    with torch.no_grad():
        # row 1 caches blocks [0, blocks - 1) in whole-block calls, in its own row of the store
        for b in range(blocks - 1):
            model.forward_cached(ids[None, b * block:(b + 1) * block], BlockCache(store.rows_view(slice(1, 2)),
                                 _at(1, b * block)), block_size=block)
        cached_keys = store.keys[0][1, :, :(blocks - 1) * block].clone()
        fed = torch.tensor([2 * block, block])
        current = torch.stack([ids[:2 * block], torch.cat([ids[(blocks - 1) * block:], ids[:block]])])
        starts = torch.tensor([0, (blocks - 1) * block])
        cache = BlockCache(store, starts, width=ids.shape[0], fed=fed, scratch=scratch,
                           fed_total=int(fed.sum()) if packed else None)
        logits = model.forward_cached(current, cache, block_size=torch.tensor([block, block]))
        _close(logits[0], model(ids[None, :2 * block], block_size=block)[0], LOGITS_ATOL)
        _close(logits[1, :block], model(ids[None], block_size=block)[0, (blocks - 1) * block:], LOGITS_ATOL)
        assert torch.equal(store.keys[0][1, :, :(blocks - 1) * block], cached_keys)


# ---- LLaDA2 --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", MOE_KERNELS)
def test_llada2_full_block_causal_forward_matches_official(llada2_model, llada2_data, kernel):
    data = llada2_data
    block = _llada2_block_size(data)
    positions = data["position_ids"]
    allowed = block_causal_mask(positions, positions, block)
    assert torch.equal(allowed, data["attention_mask_block"] == 0)
    llada2_model.set_moe_kernel(kernel)
    hidden: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            logits = llada2_model(data["input_ids"], positions, block_size=block, hidden_states_out=hidden)
            bidirectional = llada2_model(data["input_ids"], positions, block_size=data["input_ids"].shape[1])
    finally:
        llada2_model.set_moe_kernel(None)
    _close(logits, data["logits"], LOGITS_ATOL)
    assert len(hidden) == data["hidden_states"].shape[0]
    for ours, ref in zip(hidden, data["hidden_states"], strict=True):
        _close(ours, ref, LOGITS_ATOL)
    _close(bidirectional, data["logits_zero_mask"], LOGITS_ATOL)


def test_llada2_layers_and_router_match_official(llada2_model, llada2_data):
    """Per layer, from the official layer inputs: the attention output, the MLP/MoE output, and in MoE
    layers the router's logits, expert choice (in order) and weights."""
    data = llada2_data
    block = _llada2_block_size(data)
    positions = data["position_ids"]
    mask = block_causal_mask(positions, positions, block)
    cos, sin = llada2_model.rotary.forward(positions)
    moe = llada2_model.config.moe
    assert moe is not None
    with torch.no_grad():
        for i, layer in enumerate(llada2_model.layers):
            x = data["hidden_states"][i]
            attn = layer.attn.forward(layer.attn_norm.forward(x), cos, sin, mask)
            _close(attn, data["attn_out"][i], STATE_ATOL)
            normed = layer.mlp_norm.forward(x + data["attn_out"][i])
            _close(layer.mlp.forward(normed), data["mlp_out"][i], STATE_ATOL)
            if i < moe.first_dense_layers:
                assert f"moe_layer{i}_router_logits" not in data
                continue
            expert_ids, weights, router_logits = layer.mlp.router.forward(normed.reshape(-1, normed.shape[-1]))
            shape = data[f"moe_layer{i}_topk_idx"].shape
            _close(router_logits.view(*shape[:2], -1), data[f"moe_layer{i}_router_logits"], STATE_ATOL)
            assert torch.equal(expert_ids.view(shape), data[f"moe_layer{i}_topk_idx"])
            _close(weights.view(shape), data[f"moe_layer{i}_topk_weight"], STATE_ATOL)


def test_llada21_additive_mask_mode_matches_official(llada2_model, llada2_data):
    """LLaDA2.1's `generate()` adds its 0/1 block matrix to the scores: our `additive_01` mode, over
    the whole input and over the window `generate()` feeds while decoding a block."""
    data = llada2_data
    block = _llada2_block_size(data)
    positions = data["position_ids"]
    assert torch.equal(block_causal_mask(positions, positions, block).float(), data["attention_mask_block01"])
    window = data["logits_window"].shape[1]
    with torch.no_grad():
        full01 = llada2_model(data["input_ids"], positions, block_size=block, mask="additive_01")
        window01 = llada2_model(data["input_ids"][:, :window], positions[:, :window], block_size=block,
                                mask="additive_01")
        window_exact = llada2_model(data["input_ids"][:, :window], positions[:, :window], block_size=block)
    _close(full01, data["logits_block01"], LOGITS_ATOL)
    _close(window01, data["logits_window_block01"], LOGITS_ATOL)
    _close(window_exact, data["logits_window"], LOGITS_ATOL)
    # the two modes really differ on the block being decoded (earlier blocks see it under 0/1)
    assert (window01[:, -block:] - window_exact[:, -block:]).abs().max() > 1.0


def test_llada2_cached_block_matches_official(llada2_model, llada2_data):
    """The prefix (prompt + finished blocks) written to the cache by one forward, then the current
    block alone against it: the official prefix cache's keys/values and the cached block's logits."""
    data = llada2_data
    block = _llada2_block_size(data)
    ids = data["input_ids"]
    rows, prefix = ids.shape[0], data["kv_prefix_keys"].shape[3]
    current = data["logits_block_cached"].shape[1]
    store = _store(llada2_model, rows, prefix + current)
    with torch.no_grad():
        prefix_logits = llada2_model.forward_cached(ids[:, :prefix], BlockCache(store, _at(rows, 0)),
                                                    block_size=block)
        block_logits = llada2_model.forward_cached(ids[:, prefix:prefix + current],
                                                   BlockCache(store, _at(rows, prefix)), block_size=block)
    _close(prefix_logits, data["logits_prefix"], LOGITS_ATOL)
    for i in range(llada2_model.config.num_layers):
        _close(store.keys[i][:, :, :prefix], data["kv_prefix_keys"][i], STATE_ATOL)
        _close(store.values[i][:, :, :prefix], data["kv_prefix_values"][i], STATE_ATOL)
    _close(block_logits, data["logits_block_cached"], LOGITS_ATOL)
    _close(block_logits, data["logits_window"][:, prefix:prefix + current], LOGITS_ATOL)


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_grouped_experts_match_a_per_token_reference(llada2_model, tokens):
    """Every expert kernel against Σ_j w_j · expert_j(x) computed token by token, including
    experts that get no token (1 token routes to only top-k experts)."""
    experts = next(m for m in llada2_model.modules() if isinstance(m, GroupedExperts))
    moe = llada2_model.config.moe
    assert moe is not None
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, experts.hidden_size, generator=gen)
    expert_ids = torch.stack([torch.randperm(moe.num_experts, generator=gen)[:moe.experts_per_token]
                              for _ in range(tokens)])
    weights = torch.rand(tokens, moe.experts_per_token, generator=gen)
    size = experts.intermediate_size
    gate_up = experts.gate_up_proj.weight.view(moe.num_experts, 2 * size, -1)
    down = experts.down_proj.weight.view(moe.num_experts, experts.hidden_size, size)
    reference = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(moe.experts_per_token):
            e = int(expert_ids[t, j])
            gate, up = (gate_up[e] @ x[t]).split(size)
            reference[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    for kernel in MOE_KERNELS:
        experts.kernel = kernel
        try:
            with torch.no_grad():
                _close(experts.forward(x, expert_ids, weights), reference, STATE_ATOL)
        finally:
            experts.kernel = None


def test_llada2_bfloat16_tracks_float32(llada2_checkpoint, llada2_data):
    data = llada2_data
    block = _llada2_block_size(data)
    low = load_model(llada2_checkpoint, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = low(data["input_ids"], data["position_ids"], block_size=block).float()
    agree = (logits.argmax(-1) == data["logits"].argmax(-1)).float().mean().item()
    assert agree > 0.8
    assert (logits - data["logits"]).abs().mean().item() < 0.5


def test_unknown_mask_mode_and_moe_kernel_are_refused(llada2_model):
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="block mask"):
        llada2_model(ids, block_size=2, mask="causal")
    with pytest.raises(ValueError, match="MoE kernel"):
        llada2_model.set_moe_kernel("triton")
