"""`cai-dllm train --arch llada2`: the LLaDA2 config writer against the parity fixture's field set,
LLaDA2.1's editing objective, the routers' load balancing, and a short run whose checkpoint loads
(mask id from its own tokenizer files) and decodes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, load_model, load_tokenizer
from engine.decoding import DecodeParams
from engine.models.llada2 import LLaDA2Model
from engine.models.registry import FAMILIES
from engine.special_tokens import special_tokens_from_files
from tinymodels import char_tokenizer as chars
from tinymodels import llada2_recipe
from tinymodels.block_objective import block_diffusion_loss, encode_rows
from tinymodels.train import TrainConfig, build_model, train

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BLOCK = FAMILIES["llada2"].default_block


def _fixture_config() -> dict:
    [path] = sorted((FIXTURES / "block" / "llada2").glob("*/config.json"))
    return json.loads(path.read_text())


def _tiny(**changes: object) -> TrainConfig:
    fixture = _fixture_config()
    config = TrainConfig(arch="llada2", d_model=32, layers=3, heads=4, mlp_hidden=64, batch_size=8, steps=60,
                         lr=3e-3, warmup=5, checkpoint_every=10, block_size=BLOCK,
                         experts=fixture["num_experts"], experts_per_token=fixture["num_experts_per_tok"],
                         expert_hidden=16, expert_groups=fixture["n_group"],
                         expert_groups_per_token=fixture["topk_group"])
    return replace(config, **changes)


def test_the_config_has_the_released_field_set_and_the_recipes_sizes():
    fixture = _fixture_config()
    config = _tiny(shared_experts=2, dense_layers=1)
    hf = llada2_recipe.hf_config(config)
    assert list(hf) == [key for key in fixture if key != "auto_map"]  # the Hub's keys, in its order
    assert hf["model_type"] == fixture["model_type"] and hf["architectures"] == fixture["architectures"]
    parsed = LLaDA2Model.parse_config(hf)
    assert parsed.moe is not None
    assert (parsed.moe.num_experts, parsed.moe.experts_per_token) == (config.experts, config.experts_per_token)
    assert (parsed.moe.num_groups, parsed.moe.topk_group) == (config.expert_groups, config.expert_groups_per_token)
    assert (parsed.moe.num_shared_experts, parsed.moe.first_dense_layers) == (2, 1)
    assert parsed.rotary_dim == hf["rotary_dim"] and hf["pad_token_id"] == chars.special_id(chars.END)
    assert "mask_token_id" not in hf and "block_size" not in hf  # as the released file


def test_another_block_is_stated_in_the_config_and_decoded_by_default():
    """The released field set names no block (the family's default); a model trained with another
    states it, and the engine's default block for it is that one."""
    hf = llada2_recipe.hf_config(_tiny(block_size=BLOCK // 4))
    assert hf["block_size"] == BLOCK // 4 and list(hf)[-1] == "block_size"
    assert LLaDA2Model.parse_config(hf).block_size == BLOCK // 4
    assert LLaDA2Model.parse_config(llada2_recipe.hf_config(_tiny())).block_size is None


def test_the_mask_id_is_read_from_the_tokenizers_mask_token_text_when_nothing_names_it():
    tokenizer_config = {"added_tokens_decoder": {"7": {"content": "<|end|>", "special": True},
                                                 "9": {"content": "<|mask|>", "special": True}},
                        "eos_token": "<|end|>"}
    special = special_tokens_from_files({"pad_token_id": 7}, None, tokenizer_config)
    assert special.mask_id == 9 and special.eos_ids == (7,)


def _rows(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = chars.build_tokenizer()
    prompts = [e.ids for e in tokenizer.encode_batch(["00457+00038", "sum a3 b5"], add_special_tokens=False)]
    responses = [e.ids for e in tokenizer.encode_batch(["7+8+0=15;=000495", "a3=003,b5=008"],
                                                       add_special_tokens=False)]
    return encode_rows(prompts, responses, block, chars.special_id(chars.END))


class _Spy:
    """The real model, recording what it was fed and what it answered."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.special, self.calls = model, model.special, []

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        logits = self.model(*args, **kwargs)
        self.calls.append((args[0], logits))
        return logits


def test_editing_noise_replaces_only_visible_response_tokens_with_ordinary_ones():
    model, _ = build_model(_tiny())
    ids, maskable = _rows(BLOCK)
    spy = _Spy(model.eval())
    vocab = llada2_recipe.edit_vocabulary()
    with torch.no_grad():
        block_diffusion_loss(spy, ids, maskable, BLOCK, torch.Generator().manual_seed(0), 128, 0.5, vocab)
    [(fed, _)] = spy.calls
    first = ids.shape[1] - (fed.shape[1] - ids.shape[1])
    noisy, target = fed[:, :fed.shape[1] - ids.shape[1]], ids[:, first:]
    masked = noisy == model.special.mask_id
    changed = ~masked & (noisy != target)
    assert changed.any() and masked.any()
    assert not (changed & ~maskable[:, first:]).any()  # the prompt is never corrupted
    assert (noisy[changed] < vocab).all()  # random ordinary tokens, never a special one
    assert torch.equal(fed[:, -ids.shape[1]:], ids)  # the clean copy stays clean


def test_the_editing_loss_adds_every_visible_response_positions_cross_entropy():
    model, _ = build_model(_tiny())
    ids, maskable = _rows(BLOCK)
    vocab, normaliser = llada2_recipe.edit_vocabulary(), 128
    with torch.no_grad():
        plain = block_diffusion_loss(model.eval(), ids, maskable, BLOCK, torch.Generator().manual_seed(3), normaliser)
        # a share no draw reaches: the same masks and input, the visible positions' loss added
        spy = _Spy(model)
        edited = block_diffusion_loss(spy, ids, maskable, BLOCK, torch.Generator().manual_seed(3), normaliser,
                                      1e-12, vocab)
    [(fed, logits)] = spy.calls
    noisy = fed[:, :logits.shape[1]]
    first = ids.shape[1] - logits.shape[1]
    target = ids[:, first:]
    assert torch.equal(noisy[noisy != model.special.mask_id], target[noisy != model.special.mask_id])
    visible = maskable[:, first:] & (noisy != model.special.mask_id)
    ce = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none")
    expected = plain + ((ce * visible).sum(dim=1) / normaliser).mean()
    torch.testing.assert_close(edited, expected, rtol=1e-5, atol=1e-6)


def test_expert_load_moves_each_routers_bias_towards_an_even_load():
    model, _ = build_model(_tiny())
    load = llada2_recipe.ExpertLoad(model)
    tokens = torch.randint(0, llada2_recipe.edit_vocabulary(), (2, BLOCK))
    with torch.no_grad():
        model(tokens, block_size=BLOCK)
    moe_layers = len(load.routers)
    assert moe_layers == _tiny().layers - _tiny().dense_layers
    for counts, router in zip(load.counts, load.routers, strict=True):
        assert counts.sum() == tokens.numel() * router.moe.experts_per_token
    before = [r.expert_bias.clone() for r in load.routers]
    load.update_biases(0.01)
    for counts, router, old in zip(load.counts, load.routers, before, strict=True):
        step = router.expert_bias - old
        assert (step[counts > counts.mean()] < 0).all() and (step[counts < counts.mean()] > 0).all()
        assert "forward" not in vars(router)  # the class's forward again
        assert not router.expert_bias.requires_grad


@pytest.mark.slow
def test_llada2_training_loss_falls_and_the_checkpoint_decodes(tmp_path):
    log = train(_tiny(edit_noise=0.05), tmp_path, progress=False)
    losses = [loss for _, loss in log["losses"]]
    assert losses[-1] < 0.75 * losses[0]
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["architectures"] == ["LLaDA2MoeModelLM"] and "auto_map" not in config_json
    model = load_model(tmp_path)
    assert model.config.architecture == "llada2" and model.special.mask_id == chars.special_id(chars.MASK)
    biases = [p for name, p in model.named_parameters() if name.endswith("expert_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # the balancing's biases ship in the checkpoint
    engine = Engine.from_model(model, load_tokenizer(tmp_path))
    for policy in ("block-static", "block-edit"):
        [result] = engine.generate(["00457+00038"], DecodeParams(gen_length=BLOCK, policy=policy))
        assert len(result.generated_ids) > 0
