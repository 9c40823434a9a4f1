"""Tensor parallelism on CPU (gloo, 2 ranks: this process and one spawned worker), on every fixture
family: logits at TP2 equal TP1's, golden decoding runs token for token, every rank holding half of
each sharded weight and deciding the same tokens, and the step's features composed at TP2.

Sizes, inputs and runs come from the fixture files (CAI_DLLM_FIXTURES may point at another set of
the same layout). Each family starts one TP2 engine (a worker process: seconds on a busy CPU), so
every check of a family runs on it.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import FIXTURES, REPO
from fixture_checkpoints import block_fixture
from safetensors.torch import load_file

from engine import DecodeParams, Engine, EngineConfig, load_model, start_engine
from engine.decoding.registry import BLOCK, MASKED, POLICIES
from engine.errors import TensorParallelError
from engine.host_reads import count_host_reads
from engine.models.moe import GroupedExperts
from engine.models.parallel.sharding import check_divisible
from engine.models.registry import model_class_for
from engine.request import Resolved

SIZE = 2
# float32, at the logits' scale: max |TP2 - TP1| <= 1e-5 x the logits' standard deviation (the
# fixtures' logits spread with std 4.5-8 and reach |30|; the ranks' partial sums add in another order
# than one device's matmul, ~1e-5 at the largest logits: 1.3e-5 LLaDA, 7.9e-6 Dream, 1.2e-5 LLaDA2)
LOGITS_TOLERANCE = 1e-5
GOLDEN_PER_FAMILY = 3


def _parity(name: str) -> ModuleType:
    """A parity test module's golden-run helpers, loaded by path (no test of it is collected here)."""
    spec = importlib.util.spec_from_file_location(f"_tp_{name}", REPO / "tests" / "parity" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@dataclass
class Family:
    name: str
    checkpoint: Path
    reference: Any  # the TP1 model
    engine: Any  # the TP2 engine (rank 0)


def _checkpoint(name: str, tmp: Path) -> Path:
    return FIXTURES / f"{name}_tiny" if name in ("llada", "dream") else block_fixture(name, tmp)


def skip_unless_splittable(name: str, checkpoint: Path) -> None:
    """Skip, saying why, when this fixture set's checkpoint has heads (or experts) that SIZE ranks
    cannot share evenly."""
    hf = json.loads((checkpoint / "config.json").read_text())
    try:
        check_divisible(model_class_for(hf).parse_config(hf), SIZE)
    except TensorParallelError as err:
        pytest.skip(f"this fixture set's {name} model cannot be split {SIZE} ways: {err}")


@pytest.fixture(scope="module", params=["llada", "dream", "sdar", "llada2"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    checkpoint = _checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    skip_unless_splittable(request.param, checkpoint)
    engine = start_engine(EngineConfig(model=str(checkpoint), tensor_parallel_size=SIZE, max_batch=4))
    yield Family(request.param, checkpoint, load_model(checkpoint), engine)
    engine.close()


def _forward_cases(family: Family) -> list[tuple[tuple, dict[str, Any]]]:
    """(args, kwargs) of the family's forward fixtures' calls."""
    if family.name in ("llada", "dream"):
        data = load_file(FIXTURES / f"{family.name}_forward.safetensors")
        return [((data["input_ids"],), {}),
                ((data["input_ids_padded"],), {"attention_mask": data["attention_mask_padded"]})]
    data = load_file(sorted((FIXTURES / "block" / family.name).glob("*_forward.safetensors"))[0])
    mask = data["attention_mask"] if "attention_mask" in data else data["attention_mask_block"][:, 0]
    allowed = (mask[0, 0] == 1) if "attention_mask" in data else (mask[0, 0] == 0)
    block = int(allowed.sum())  # the first query sees its own block
    cases = [((data["input_ids"], data["position_ids"]), {"block_size": block})]
    if family.name == "llada2":
        cases.append(((data["input_ids"], data["position_ids"]), {"block_size": block, "mask": "additive_01"}))
    return cases


def test_logits_at_tp2_equal_tp1(family: Family) -> None:
    for args, kwargs in _forward_cases(family):
        with torch.no_grad():
            want = family.reference(*args, **kwargs)
        [got] = family.engine.collective_rpc("tp_calls:forward", args, kwargs)
        assert got.shape == want.shape
        real = kwargs["attention_mask"].bool() if "attention_mask" in kwargs else torch.ones(want.shape[:2]).bool()
        error = (got[real] - want[real]).abs().max().item()
        assert error <= LOGITS_TOLERANCE * max(1.0, want[real].std().item()), (family.name, kwargs.keys(), error)


def test_each_rank_holds_its_share_of_every_sharded_weight(family: Family) -> None:
    whole = {name: tuple(p.shape) for name, p in family.reference.named_parameters()}
    ranks = family.engine.collective_rpc("tp_calls:shard_shapes", results=True)
    assert len(ranks) == SIZE
    for name, shape in whole.items():
        shapes = [rank[name] for rank in ranks if name in rank]
        if ".experts." in name:  # each rank stacks its own experts: together, all of them once
            assert sum(s[0] for s in shapes) == shape[0]
        elif name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
            assert all(s[0] * SIZE == shape[0] for s in shapes), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert all(s[1] * SIZE == shape[1] for s in shapes), name
        elif name.startswith(("embed.", "lm_head.")):
            assert all(s[0] == -(-shape[0] // SIZE) for s in shapes), name
        else:  # norms, the router: replicated
            assert all(s == shape for s in shapes), name


# ---- golden runs ---------------------------------------------------------------------------------

def _masked_runs(family: Family) -> list[tuple[list[list[int]], DecodeParams, list[list[int]], int]]:
    """(prompts, params, expected ids, expected NFE) of a few golden runs, one per cache mode."""
    golden = _parity("test_golden_decoding")
    prefix = "dream" if family.name == "dream" else "llada"
    chosen: dict[str, tuple] = {}
    for path in sorted((FIXTURES / "golden").glob("*.json")):
        name = path.stem
        ours = name.startswith(("dream", "fastdllm_dream")) == (prefix == "dream")
        run = json.loads(path.read_text())
        if not ours or golden._not_reproduced(name, run["settings"]) is not None:
            continue
        fields, strip_pads = golden._params(name, run["settings"])
        key = fields.get("cache", "none")
        if key in chosen:
            continue
        prompts = run["prompt_ids"]
        if strip_pads:
            mask = run["settings"]["attention_mask"]
            prompts = [[t for t, keep in zip(p, m, strict=True) if keep] for p, m in zip(prompts, mask, strict=True)]
        idle = sum(1 for n in run.get("tokens_committed_per_forward", []) if n == 0)
        chosen[key] = (prompts, DecodeParams(**fields), run["generated_ids"],
                       run.get("nfe", run.get("nfe_counted")) - idle)
    return list(chosen.values())[:GOLDEN_PER_FAMILY]


def _block_runs(family: Family) -> list[tuple[list[list[int]], DecodeParams, list[list[int]], list[int]]]:
    """A few golden runs this engine's checkpoint and special ids reproduce, one per decoder."""
    golden = _parity("test_block_golden")
    config = json.loads((family.checkpoint / "generation_config.json").read_text())
    end_ids = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    chosen: dict[tuple, tuple] = {}
    for path in sorted((FIXTURES / "block" / family.name / "golden").glob("*.json")):
        run = json.loads(path.read_text())
        stops = golden._stop_ids(run)
        same_model = run.get("model") in (None, family.checkpoint.name.split("-", 1)[1])
        if golden._skip_reason(run) is not None or not same_model or stops not in ([], end_ids):
            continue
        params = golden._params(run)
        key = (run.get("code_version"), params.policy, len(golden._rows(run["prompt_ids"])) > 1)
        if key in chosen:
            continue
        rows = golden._rows(run["prompt_ids"])
        chosen[key] = (rows, params, [golden._expected(run, r) for r in range(len(rows))],
                       [golden._row_nfe(run, r) for r in range(len(rows))])
    return list(chosen.values())[:GOLDEN_PER_FAMILY]


def test_golden_runs_token_for_token_at_tp2(family: Family) -> None:
    engine = family.engine
    if family.name in ("llada", "dream"):
        runs = _masked_runs(family)
        assert runs
        for prompts, params, expected, nfe in runs:
            results = engine.generate(prompts, params)
            assert [r.generated_ids for r in results] == expected
            assert all(r.stats.nfe == nfe for r in results)
    else:
        golden = _parity("test_block_golden")
        runs = _block_runs(family)
        assert runs
        for prompts, params, expected, nfe in runs:
            results = engine.generate(prompts, params)
            assert [golden._through_end(r) for r in results] == expected
            assert [r.stats.nfe + _restored_prefill(r, engine.resolve(r.prompt_ids, params)) for r in results] == nfe
    digests = engine.collective_rpc("engine.executor.calls:state_digest", results=True)
    assert len(set(digests)) == 1


def _restored_prefill(result: Any, resolved: Resolved) -> int:
    """1 where the prefix cache (on by default: every rank caches its own heads) restored all of a
    prompt's whole blocks, so SDAR's store pass had no prefill forward to run."""
    whole = resolved.geometry.origin
    return int(resolved.params.store_pass and 0 < whole == result.stats.cached_tokens)


# ---- the step composed at TP2 -------------------------------------------------------------------

def _workload(family: Family) -> list[tuple[list[int], DecodeParams]]:
    """More requests than rows, one per decoding policy the family takes, across its caches, with
    seeded sampling, logprobs, top-k, min-p, top-p (the one filter that gathers the logits) and
    (LLaDA) guidance on some."""
    block = family.name in ("sdar", "llada2")
    if block:
        policies = [name for name, p in POLICIES.items() if BLOCK in p.modes]
        caches = ["exact", "none"]
    else:
        policies = [name for name, p in POLICIES.items() if MASKED in p.modes]
        caches = ["none", "prefix", "dual"]
    work = []
    for i, policy in enumerate(policies):
        params = DecodeParams(policy=policy, cache=caches[i % len(caches)], gen_length=16,
                              block_length=4 if block or i % 2 else 8, threshold=0.5,
                              logprobs=2 if i % 3 == 0 else None,
                              temperature=0.7 if i == 4 else 0.0, seed=i, ignore_eos=True,
                              top_k=3 if i % 4 == 1 else 0, min_p=0.05 if i % 5 == 2 else 0.0,
                              top_p=0.9 if i == 6 else 1.0,
                              cfg_scale=1.0 if i == 3 and family.name == "llada" else 0.0)
        if policy.startswith("dream-"):
            params = params.with_overrides(block_length=None, cache="none")
        if params.cfg_scale:
            params = params.with_overrides(cache="none")
        work.append(([3 + i, 7, 11, 5, 9][: 2 + i % 4], params))
    return work


def _run(engine: Engine, work: list[tuple[list[int], DecodeParams]], abort_at: int = -1,
         count_reads: bool = False) -> dict[str, Any]:
    """Each request's (generated ids, logprobs); request 1 aborted after `abort_at` steps."""
    ids = [engine.add_request(prompt, params, request_id=f"r{i}") for i, (prompt, params) in enumerate(work)]
    results: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == abort_at:
            engine.abort(ids[1])
        if count_reads:
            with count_host_reads() as reads:
                outputs = engine.step()
            assert reads.count == 1 or engine.model.config.moe is not None, reads.by_method
        else:
            outputs = engine.step()
        steps += 1
        for out in outputs:
            if out.result is not None:
                results[out.request_id] = (out.result.generated_ids, out.result.logprobs)
    return results


def test_every_feature_at_tp2_gives_tp1_tokens(family: Family) -> None:
    """Policies, caches, seeded sampling, logprobs and guidance in one batch, a request aborted
    mid-run: the tokens and logprobs of TP1, one host read per step on rank 0 (LLaDA2's plain MoE
    kernel reads its experts' counts inside the forward, as it does at TP1), every rank in step."""
    work = _workload(family)
    want = _run(Engine.from_model(family.reference, max_batch=4), work, abort_at=2)
    got = _run(family.engine, work, abort_at=2, count_reads=True)
    assert "r1" not in got and set(got) == set(want)
    for request_id, (tokens, logprobs) in want.items():
        assert got[request_id][0] == tokens, request_id
        if logprobs is not None:
            for mine, theirs in zip(got[request_id][1], logprobs, strict=True):
                assert mine.token_id == theirs.token_id
                assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    digests = family.engine.collective_rpc("engine.executor.calls:state_digest", results=True)
    assert len(set(digests)) == 1


def test_likelihood_scoring_at_tp2_equals_tp1(family: Family) -> None:
    if family.name not in ("llada", "dream"):
        pytest.skip("likelihood scoring is for full-attention masked diffusion models")
    prompt = [5, 9, 14, 3, 22, 7]
    want = Engine.from_model(family.reference).score(prompt, samples=3, seed=1)
    got = family.engine.score(prompt, samples=3, seed=1)
    assert got[0] is None and want[0] is None
    assert got[1:] == pytest.approx(want[1:], abs=1e-4)


def _expected_shard(whole_module: Any, whole: torch.Tensor, mine: Any, rank: int) -> torch.Tensor:
    """This rank's part of a whole parameter, by the layout `tp_split` names (the loader's reads,
    re-derived on tensors)."""
    split = getattr(mine, "tp_split", None)
    if split == "out" and hasattr(whole_module, "shard_offsets"):
        parts = []
        for name, (start, size) in whole_module.shard_offsets.items():
            local = mine.shard_offsets[name][1]
            parts.append(whole[start:start + size][rank * local:(rank + 1) * local])
        return torch.cat(parts)
    if split == "in":
        columns = whole.shape[1] // SIZE
        return whole[:, rank * columns:(rank + 1) * columns]
    if split == "vocab":
        rows = -(-whole.shape[0] // SIZE)
        part = whole[rank * rows:(rank + 1) * rows]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    if split == "experts":
        rows = whole.shape[0] // SIZE
        return whole[rank * rows:(rank + 1) * rows]
    return whole


@pytest.mark.parametrize("name", ["llada", "dream", "sdar", "llada2"])
def test_each_rank_loads_exactly_its_slices_and_reads_little_else(name: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading needs no process group: each rank's parameters are the slices of the whole model's
    it should hold, and it reads from the files about its share of the bytes (plus what it holds
    whole), never the whole checkpoint."""
    from engine.loading import weights
    from engine.models.parallel.group import TensorParallel

    checkpoint = _checkpoint(name, tmp_path)
    skip_unless_splittable(name, checkpoint)
    whole = load_model(checkpoint)
    file_bytes = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    replicated = sum(p.nbytes for n, p in whole.named_parameters() if "norm" in n or "router" in n)
    for rank in range(SIZE):
        read = [0]

        def counting_open(path: Any, *args: Any, read: list = read, **kwargs: Any) -> Any:
            handle = open(path, *args, **kwargs)
            original = handle.readinto

            def readinto(buffer: Any) -> int:
                got = original(buffer)
                read[0] += got or 0
                return got

            handle.readinto = readinto
            return handle

        monkeypatch.setattr(weights, "open", counting_open, raising=False)
        mine = load_model(checkpoint, tp=TensorParallel(rank, SIZE))
        monkeypatch.undo()
        for param_name, param in mine.named_parameters():
            module_name = param_name.rsplit(".", 1)[0]
            expected = _expected_shard(whole.get_submodule(module_name), whole.get_parameter(param_name),
                                       mine.get_submodule(module_name), rank)
            assert torch.equal(param, expected), param_name
        assert 0 < read[0] <= (file_bytes - replicated) / SIZE + replicated + file_bytes * 0.02, (rank, read[0])


@pytest.mark.parametrize("device, dtype, kernel", [
    ("cpu", torch.float32, "plain"),
    pytest.param("cuda", torch.bfloat16, "grouped_mm", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="grouped_mm's documented device is CUDA (bf16); no GPU here")),
])
def test_routed_experts_split_across_ranks_sum_to_the_whole(device: str, dtype: torch.dtype, kernel: str) -> None:
    """Expert parallelism without a group: two ranks' GroupedExperts (each its half of the experts,
    the same global routing) add up to one device's, whichever kernel runs them."""
    hidden, inner, experts, tokens, top_k = 64, 32, 8, 50, 2
    gen = torch.Generator(device=device).manual_seed(0)
    whole = GroupedExperts(hidden, inner, experts).to(device, dtype)
    halves = [GroupedExperts(hidden, inner, experts, r * experts // 2, experts // 2).to(device, dtype) for r in (0, 1)]
    with torch.no_grad():
        for param in (whole.gate_up_proj.weight, whole.down_proj.weight):
            param.normal_(0, 0.1, generator=gen)
        for rank, half in enumerate(halves):
            for mine, theirs in ((half.gate_up_proj, whole.gate_up_proj), (half.down_proj, whole.down_proj)):
                rows = mine.weight.shape[0]
                mine.weight.copy_(theirs.weight[rank * rows:(rank + 1) * rows])
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
        ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, device=device, generator=gen)
        for module in (whole, *halves):
            module.kernel = kernel
        want = whole(x, ids, weights).float()
        got = halves[0](x, ids, weights).float() + halves[1](x, ids, weights).float()
    # float32: summation order only; bf16: each rank rounds its partial sum to bf16 once
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert ((got - want).norm() / want.norm()).item() < tolerance


def test_a_size_that_does_not_divide_the_model_is_refused_naming_both_numbers() -> None:
    hf = json.loads((FIXTURES / "llada_tiny" / "config.json").read_text())
    heads = model_class_for(hf).parse_config(hf).num_heads
    size = heads + 1
    with pytest.raises(TensorParallelError, match=rf"--tensor-parallel-size {size} does not divide the model's "
                                                   rf"{heads} attention heads"):
        start_engine(EngineConfig(model=str(FIXTURES / "llada_tiny"), tensor_parallel_size=size))


@pytest.mark.skipif(torch.cuda.device_count() < SIZE, reason=f"needs {SIZE} CUDA GPUs (NCCL); this machine has "
                                                             f"{torch.cuda.device_count()}")
def test_nccl_on_two_gpus_gives_one_gpus_logits() -> None:
    data = load_file(FIXTURES / "llada_forward.safetensors")
    checkpoint = FIXTURES / "llada_tiny"
    reference = load_model(checkpoint, device="cuda:0")
    engine = start_engine(EngineConfig(model=str(checkpoint), device="cuda", tensor_parallel_size=SIZE))
    try:
        ids = data["input_ids"].cuda()
        with torch.no_grad():
            want = reference(ids)
        [got] = engine.collective_rpc("tp_calls:forward", (ids,), {})
        assert (got - want).abs().max().item() <= 1e-4  # TF32/reduction order on a GPU
        results = engine.generate([[1, 2, 3, 4]], DecodeParams(gen_length=16, block_length=8, cache="dual"))
        assert results[0].generated_ids == Engine.from_model(reference).generate(
            [[1, 2, 3, 4]], DecodeParams(gen_length=16, block_length=8, cache="dual"))[0].generated_ids
    finally:
        engine.close()
