"""A short smoke training of each format: the loss falls, the checkpoint loads, resuming is exact;
the block-diffusion objective's rows and attention mask on hand-built examples."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from engine import Engine, load_model, load_tokenizer
from engine.decoding import DecodeParams
from engine.loading.checkpoint import CheckpointFiles
from tinymodels.block_objective import encode_rows, noisy_clean_mask
from tinymodels.tasks import sample
from tinymodels.train import TrainConfig, build_model, masked_diffusion_loss, micro_batches, train


def _small(arch: str, steps: int, optimizer: str = "adamw") -> TrainConfig:
    return TrainConfig(arch=arch, d_model=48, layers=2, heads=4, mlp_hidden=96, batch_size=8, steps=steps,
                       lr=3e-3, warmup=5, checkpoint_every=10, optimizer=optimizer)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "optimizer"), [("llada", "adamw"), ("dream", "adamw"), ("llada", "muon")])
def test_smoke_training_loss_falls_and_checkpoint_loads(arch, optimizer, tmp_path):
    log = train(_small(arch, 100, optimizer), tmp_path, progress=False)
    losses = [loss for _, loss in log["losses"]]  # means over 25 steps each
    # v2's long worked answers fall more slowly than v1's short ones (Muon: 2.32 -> 1.51 by step 100)
    assert losses[-1] < 0.75 * losses[0]
    model = load_model(tmp_path)
    assert model.config.architecture == arch
    assert model.logits_shifted == (arch == "dream")
    tokenizer = load_tokenizer(tmp_path)
    special = CheckpointFiles.open(tmp_path).special_tokens()
    assert special.mask_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert special.eos_id == special.eot_id == tokenizer.convert_tokens_to_ids("<|end|>")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == (["LLaDAModelLM"] if arch == "llada" else ["DreamModel"])
    assert "auto_map" not in config  # no remote code to trust: none is shipped
    assert json.loads((tmp_path / "training_log.json").read_text())["step"] == 100


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_exactly(optimizer, tmp_path):
    config = _small("llada", 30, optimizer)
    straight = train(config, tmp_path / "straight", progress=False)
    stopped = train(config, tmp_path / "resumed", progress=False, stop_at=15)
    assert stopped["step"] == 15
    resumed = train(config, tmp_path / "resumed", resume=True, progress=False)
    assert resumed["step"] == 30
    assert resumed["losses"] == straight["losses"]
    a = load_model(tmp_path / "straight").state_dict()
    b = load_model(tmp_path / "resumed").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="another training config"):
        train(_small("llada", 40, optimizer), tmp_path / "resumed", resume=True, progress=False)


class _RecordingModel(torch.nn.Module):
    """Stands in for a model: remembers the noisy input it was given, returns uniform logits."""

    logits_shifted = False

    def __init__(self, vocab: int, mask_id: int) -> None:
        super().__init__()
        self.special = type("Special", (), {"mask_id": mask_id})()
        self.bias = torch.nn.Parameter(torch.zeros(vocab))
        self.seen: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.seen.append(ids.clone())
        return self.bias.expand(*ids.shape, -1)


def test_prefix_masking_keeps_a_response_prefix_visible():
    mask_id, canvas_len, prompt_len = 5, 40, 10
    ids = torch.randint(0, 5, (512, prompt_len + canvas_len))
    attention = torch.ones_like(ids)
    canvas = torch.zeros_like(ids, dtype=torch.bool)
    canvas[:, prompt_len:] = True
    model = _RecordingModel(8, mask_id)
    loss = masked_diffusion_loss(model, ids, attention, canvas, torch.Generator().manual_seed(0), canvas_len,
                                 prefix_mask_share=1.0)
    loss.backward()
    masked = model.seen[0] == mask_id
    assert not masked[:, :prompt_len].any()  # the prompt is never masked
    # a cut drawn uniformly over the canvas: early positions are rarely after it, late ones usually
    rate = masked[:, prompt_len:].float().mean(0)
    assert rate[:8].mean() < 0.5 * rate[-8:].mean()
    first = [int(row.nonzero()[0]) for row in masked[:, prompt_len:] if row.any()]
    assert len(set(first)) > 5  # the cut moves from example to example

    plain = _RecordingModel(8, mask_id)
    masked_diffusion_loss(plain, ids, attention, canvas, torch.Generator().manual_seed(0), canvas_len)
    plain_rate = (plain.seen[0] == mask_id)[:, prompt_len:].float().mean(0)
    assert plain_rate[:8].mean() > 0.7 * plain_rate[-8:].mean()  # LLaDA's draw: uniform over the canvas
    assert (plain.seen[0] == mask_id).sum() > masked.sum()


def test_prefix_mask_share_is_validated():
    with pytest.raises(ValueError, match="prefix_mask_share"):
        TrainConfig(prefix_mask_share=1.5)


def test_init_from_starts_at_a_checkpoints_weights(tmp_path):
    first = _small("llada", 2)
    train(first, tmp_path / "first", progress=False)
    trained = load_model(tmp_path / "first")
    train(replace(first, steps=0, init_from=str(tmp_path / "first")), tmp_path / "second", progress=False)
    again = load_model(tmp_path / "second")
    for (name, a), (_, b) in zip(trained.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="dream"):
        train(replace(_small("dream", 0), init_from=str(tmp_path / "first")), tmp_path / "third", progress=False)


def test_mix_is_validated_and_reaches_the_cli():
    from server.cli import build_parser

    for bad in ({"mul": 1.0}, {}, {"add": 0.0}):
        with pytest.raises(ValueError, match="mix"):
            TrainConfig(mix=bad)
    args = build_parser().parse_args(["train", "--out", "x", "--mix", "add=1,swap=3"])
    assert args.mix == {"add": 1.0, "swap": 3.0}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--out", "x", "--mix", "add=1,mul=3"])


def test_both_prompt_forms_are_encoded_as_the_server_sends_them():
    from tinymodels import char_tokenizer as chars
    from tinymodels.tasks import sample
    from tinymodels.train import encode_examples

    problems = sample(2, seed=0, split="train")
    ids, attention, canvas = encode_examples(problems, 80, plain=[True, False])
    tokenizer = chars.build_tokenizer()
    width = ids.shape[1] - 80
    expected_prompts = [problems[0].prompt, chars.render_user_prompt(problems[1].prompt)]
    for row, problem, expected in zip(range(2), problems, expected_prompts, strict=True):
        prompt = ids[row, :width][attention[row, :width].bool()].tolist()
        assert tokenizer.decode(prompt, skip_special_tokens=False) == expected
        assert tokenizer.decode(ids[row, width:width + len(problem.response)].tolist()) == problem.response
    assert canvas[:, width:].all() and not canvas[:, :width].any()


def test_plain_prompt_share_draws_both_forms(monkeypatch):
    import tinymodels.train as training

    seen: list[list[bool]] = []
    real = training.encode_examples

    def spy(batch, gen_length, plain=None):
        seen.append(list(plain))
        return real(batch, gen_length, plain)

    monkeypatch.setattr(training, "encode_examples", spy)
    config = TrainConfig(d_model=32, layers=1, heads=2, mlp_hidden=64, batch_size=16, steps=2, warmup=1)
    model, _ = training.build_model(config)
    training.train_step(model, training.make_optimizer(model, config), config, 0)
    drawn = [flag for group in seen for flag in group]
    assert len(drawn) == 16 and 0 < sum(drawn) < 16
    seen.clear()
    only_chat = TrainConfig(d_model=32, layers=1, heads=2, mlp_hidden=64, batch_size=16, steps=2, warmup=1,
                            plain_prompt_share=0.0)
    training.train_step(model, training.make_optimizer(model, only_chat), only_chat, 0)
    assert not any(flag for group in seen for flag in group)
    with pytest.raises(ValueError, match="plain_prompt_share"):
        TrainConfig(plain_prompt_share=-0.1)


def test_snapshot_writes_the_saved_state_as_a_checkpoint(tmp_path):
    from tinymodels.train import snapshot

    config = _small("dream", 12)
    config = TrainConfig(**{**config.__dict__, "checkpoint_every": 5, "d_model": 32, "layers": 1, "mlp_hidden": 64})
    train(config, tmp_path / "run", progress=False, stop_at=10)
    log = snapshot(tmp_path / "run", tmp_path / "snap")
    assert log["step"] == 10
    model = load_model(tmp_path / "snap")
    assert model.config.architecture == "dream" and (tmp_path / "snap" / "tokenizer.json").is_file()
    from tinymodels.evaluate import model_mix

    assert model_mix(str(tmp_path / "snap")) == config.mix  # a mid-run eval asks about the kinds being learned
    with pytest.raises(FileNotFoundError):
        snapshot(tmp_path / "nothing", tmp_path / "snap2")


def test_full_canvases_reach_long_canvas_and_only_when_asked():
    batch = sample(32, seed=0, split="train")
    for long_canvas, allowed in [(128, {128}), (256, set(range(128, 257)))]:
        config = TrainConfig(full_canvas_share=1.0, long_canvas=long_canvas)
        generator = torch.Generator().manual_seed(0)
        canvases = {canvas for _ in range(20) for _, canvas in micro_batches(config, batch, generator)}
        assert canvases <= allowed and (len(canvases) > 1) == (long_canvas > 128)
    with pytest.raises(ValueError, match="long_canvas"):
        TrainConfig(long_canvas=64)


def test_block_rows_keep_the_prompt_at_position_0_and_close_the_end_block_plus_one():
    ids, maskable = encode_rows([[1, 2, 3], [1]], [[4, 5], [4, 5, 6, 7, 8, 9]], block_size=4, end_id=0)
    # row 0: 5 tokens, its end token at 5 closes block 1 (to 8), then one whole block of end tokens
    # row 1: 7 tokens, end at 7, block 1 ends at 8, plus a block: 12 as well
    assert ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0], [1, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0, 0]]
    assert maskable.tolist() == [[False] * 3 + [True] * 9, [False] + [True] * 11]
    ids, _ = encode_rows([[1, 2, 3]], [[4, 5, 6, 7]], block_size=4, end_id=0)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0]]  # an end token that opens a block


def test_noisy_clean_mask_on_a_hand_built_example():
    # block size 2; noisy copy of positions 2..5 (blocks 1, 2), clean copy of positions 0..5 (blocks 0..2)
    mask = noisy_clean_mask(torch.arange(2, 6), torch.arange(6), block_size=2)[0, 0].int().tolist()
    #            noisy 2 3 4 5 | clean 0 1 2 3 4 5
    expected = [[1, 1, 0, 0, 1, 1, 0, 0, 0, 0],  # noisy 2: its noisy block, clean block 0
                [1, 1, 0, 0, 1, 1, 0, 0, 0, 0],
                [0, 0, 1, 1, 1, 1, 1, 1, 0, 0],  # noisy 4: its noisy block, clean blocks 0-1, never clean 4-5
                [0, 0, 1, 1, 1, 1, 1, 1, 0, 0],
                [0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # clean 0: clean blocks <= 0, no noisy token
                [0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
                [0, 0, 0, 0, 1, 1, 1, 1, 0, 0],
                [0, 0, 0, 0, 1, 1, 1, 1, 0, 0],
                [0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
                [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]]
    assert mask == expected


def _tiny_sdar() -> torch.nn.Module:
    model, _ = build_model(TrainConfig(arch="sdar", d_model=32, layers=2, heads=4, mlp_hidden=64, block_size=4))
    return model.eval()


def test_noisy_block_logits_are_the_decoders_and_never_see_their_own_clean_copy():
    model = _tiny_sdar()
    block, width = 4, 12
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(6, 60, (1, width), generator=generator)
    noisy = clean.clone()
    noisy[0, [5, 6, 9, 11]] = model.special.mask_id  # blocks 1 and 2 partly masked; block 0 all prompt
    positions = torch.arange(width)
    attention = noisy_clean_mask(positions, positions, block)
    both = torch.cat([noisy, clean], dim=1)
    with torch.no_grad():
        out = model(both, torch.cat([positions, positions])[None], block_size=block, attention_mask=attention)
        for b in range(width // block):  # what the decoder computes for block b: clean blocks < b, then noisy b
            end = (b + 1) * block
            seq = torch.cat([clean[:, :b * block], noisy[:, b * block:end]], dim=1)
            decoder = model(seq, block_size=block)[:, b * block:end]
            torch.testing.assert_close(out[:, b * block:end], decoder, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[:, width:], model(clean, block_size=block), rtol=1e-5, atol=1e-5)
        # changing block 1's clean copy leaves block 1's noisy outputs alone and moves block 2's
        changed = both.clone()
        changed[0, width + 5] = 7 if int(clean[0, 5]) != 7 else 8
        moved = model(changed, torch.cat([positions, positions])[None], block_size=block, attention_mask=attention)
    torch.testing.assert_close(moved[:, 4:8], out[:, 4:8], rtol=0, atol=0)
    assert not torch.allclose(moved[:, 8:12], out[:, 8:12])


def test_an_explicit_attention_mask_must_be_boolean():
    model = _tiny_sdar()
    with pytest.raises(ValueError, match="attention_mask must be bool"):
        model(torch.zeros(1, 4, dtype=torch.long), block_size=4, attention_mask=torch.ones(1, 1, 4, 4))


@pytest.mark.slow
def test_sdar_training_loss_falls_and_the_checkpoint_decodes(tmp_path):
    config = replace(_small("sdar", 60), block_size=4)
    log = train(config, tmp_path, progress=False)
    losses = [loss for _, loss in log["losses"]]
    assert losses[-1] < 0.75 * losses[0]
    model = load_model(tmp_path)
    assert model.config.architecture == "sdar" and model.block_size == 4
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["architectures"] == ["SDARForCausalLM"] and "auto_map" not in config_json
    engine = Engine.from_model(model, load_tokenizer(tmp_path))
    [result] = engine.generate(["00457+00038"], DecodeParams(gen_length=16, policy="block-static"))
    assert len(result.generated_ids) > 0
