"""Server pieces without HTTP: settings, energy meters (fake counters), stop strings, mappings."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from engine.decoding.params import canvas_for_max_tokens, canvas_within
from server.energy import EnergyMeter, NvmlMeter, RaplMeter, open_meter, share_energy
from server.output import ChoiceOutput, IncrementalDetokenizer, find_stop, finish_reason_of, held_back
from server.protocol import new_id
from server.serving_base import DISCONNECT_POLL_SECONDS, DisconnectWatch
from server.settings import BUNDLED_MODEL, load_settings


def test_settings_precedence_flags_env_defaults():
    env = {"CAI_DLLM_PORT": "9001", "CAI_DLLM_MAX_BATCH": "4", "CAI_DLLM_DEFAULT_DECODING": '{"cache": "dual"}',
           "CAI_DLLM_API_KEY": "k"}
    settings = load_settings({"port": 9100, "max_batch": None}, env)
    assert settings.port == 9100  # the flag wins
    assert settings.engine.max_batch == 4  # then the environment
    assert settings.default_decoding == {"cache": "dual"} and settings.api_key == "k"
    assert settings.max_queue == 64  # then the default
    assert load_settings({}, {}).engine.model == str(BUNDLED_MODEL)
    assert load_settings({}, {}).model_name == "llada-tiny"


def test_engine_settings_are_one_engine_config(fixtures):
    from engine import EngineConfig
    from server.app import _load_engine

    settings = load_settings({"max_model_len": 96, "dtype": None},
                             {"CAI_DLLM_DTYPE": "bfloat16", "CAI_DLLM_USE_FLASH_ATTN": "false"})
    assert settings.engine == EngineConfig(model=str(BUNDLED_MODEL), dtype="bfloat16", max_model_len=96,
                                           use_flash_attn=False)
    assert (settings.engine.max_model_len, settings.engine.dtype, settings.engine.device) == (96, "bfloat16", "cpu")
    tiny = load_settings({"model": str(fixtures / "llada_tiny"), "max_model_len": 96}, {})
    assert _load_engine(tiny).max_model_len == 96  # --max-model-len reaches the engine


def test_serve_flags_take_their_defaults_from_the_settings():
    from server.cli import build_parser
    from server.settings import ServerSettings, setting_default, setting_names

    parser = build_parser()
    args = parser.parse_args(["serve", "--max-num-seqs", "3", "--dtype", "BF16"])
    assert (args.max_batch, args.dtype, args.port, args.model) == (3, "bf16", None, None)  # None: not given
    assert set(setting_names()) >= {"model", "max_batch", "max_model_len", "port", "log_level"}
    assert setting_default("max_batch") == ServerSettings().engine.max_batch
    assert setting_default("max_queue") == ServerSettings().max_queue
    assert parser.parse_args(["generate", "--model", "m"]).max_batch == ServerSettings().engine.max_batch


@pytest.mark.parametrize("env", [{"CAI_DLLM_PORT": "x"}, {"CAI_DLLM_MAX_BATCH": "0"},
                                 {"CAI_DLLM_DEFAULT_DECODING": "{bad"}, {"CAI_DLLM_REQUEST_TIMEOUT": "-1"},
                                 {"CAI_DLLM_THREADS": "0"}, {"CAI_DLLM_MAX_MODEL_LEN": "1"},
                                 {"CAI_DLLM_DTYPE": "int8"}, {"CAI_DLLM_LOG_LEVEL": "loud"}])
def test_bad_settings_are_refused(env):
    with pytest.raises(ValueError):
        load_settings({}, env)


def test_nvml_meter_converts_millijoules():
    readings = iter([1_000, 3_500])
    meter = NvmlMeter(lambda: next(readings))
    assert meter.read_joules() == 1.0 and meter.read_joules() == 3.5 and meter.name == "nvml"


def test_rapl_meter_accumulates_and_handles_wraparound():
    readings = iter([[900_000, 10], [950_000, 20], [50_000, 30]])
    meter = RaplMeter(lambda: next(readings), max_ranges=[1_000_000, 1_000_000])
    assert meter.read_joules() == 0.0
    assert meter.read_joules() == pytest.approx((50_000 + 10) / 1e6)
    # package 0 wrapped: 950000 -> 50000 is +100000 uJ
    assert meter.read_joules() == pytest.approx((50_000 + 10 + 100_000 + 10) / 1e6)


def test_rapl_meter_absent_when_unreadable(tmp_path):
    assert RaplMeter.open(tmp_path) is None
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "energy_uj").write_text("123\n")
    (zone / "max_energy_range_uj").write_text("1000\n")
    meter = RaplMeter.open(tmp_path)
    assert meter is not None and meter.read_joules() == 0.0


def test_no_meter_reports_nothing():
    assert EnergyMeter().read_joules() is None
    assert open_meter("cuda:0").name in ("none", "nvml")


def test_energy_is_shared_by_work():
    assert share_energy(10.0, {"a": 3, "b": 1}) == {"a": 7.5, "b": 2.5}
    assert share_energy(5.0, {"a": 0}) == {"a": 0.0}


def test_stop_strings():
    assert find_stop("a=12;b=3", [";"]) == len("a=12")
    assert find_stop("abc", ["x", ""]) == -1
    assert find_stop("one two three", ["three", "two"]) == len("one ")
    # hold back a tail that might become a stop string; never hold back more than needed
    assert held_back("hello wor", ["world"]) == len("wor")
    assert held_back("hello", ["xyz"]) == 0
    assert held_back("caf\ufffd", []) == 1


class _CharTokenizer:
    """decode = the characters of the ids (one per id), as the built-in models' tokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_choice_output_cuts_at_the_end_token_and_at_a_stop_string_across_deltas():
    out = ChoiceOutput(0, "r", [1], _CharTokenizer(), end_ids={25}, stops=["cd"])
    out.add([0, 1])
    assert out.take() == "ab"
    out.add([2])  # "abc": the "c" may begin "cd", so it waits
    assert out.take() == "" and out.text == "abc"
    out.add([3, 4])  # "abcde": the stop string arrived across two deltas
    assert out.stopped_by_string and out.text == "ab" and out.take() == ""
    out.finish(None)
    assert out.finish_reason == "stop" and out.completion_tokens(len) == 2

    ended = ChoiceOutput(1, "s", [1], _CharTokenizer(), end_ids={25}, stops=[])
    ended.add([0, 1, 25, 2])  # nothing after the end token counts
    assert ended.text == "ab" and ended.take() == "ab" and ended.token_ids == [0, 1]
    ended.finish(None)
    assert ended.completion_tokens(len) == 3  # the end token counts, as in vLLM

    at_once = ChoiceOutput(2, "t", [1], _CharTokenizer(), end_ids={25}, stops=[], max_tokens=4)
    at_once.add([25])
    at_once.finish(None)
    assert at_once.text == "" and at_once.completion_tokens(len) == 1

    # one delta that reaches max_tokens with a stop string inside them: the stop string ends it
    block = ChoiceOutput(3, "u", [1], _CharTokenizer(), end_ids={25}, stops=["cd"], max_tokens=6)
    block.add([0, 1, 2, 3, 4, 5, 6, 7])
    block.finish(None)
    assert block.text == "ab" and block.finish_reason == "stop" and block.completion_tokens(len) == 2
    cut = ChoiceOutput(3, "u", [1], _CharTokenizer(), end_ids={25}, stops=[], max_tokens=2)
    cut.add([0, 1, 25])  # the end token would be the third token: cut at max_tokens, never generated
    cut.finish(None)
    assert cut.finish_reason == "length" and cut.completion_tokens(len) == 2


def test_incremental_detokenizer_equals_a_whole_decode(fixtures):
    from engine.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(fixtures / "real" / "dream-v0-instruct-7b")
    text = "Déjà vu: 12 × 34 = 408 ✓ — naïve café, 日本語のテキスト, emoji 🙂🙃!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for split in (1, 2, 3, 5):
        detok = IncrementalDetokenizer(tokenizer)
        for start in range(0, len(ids), split):
            detok.add(ids[start:start + split])
            assert "\ufffd" not in detok.text
        detok.flush()
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_finish_reason_mapping():
    assert finish_reason_of("stop", False) == "stop"
    assert finish_reason_of("length", False) == "length"
    assert finish_reason_of("length", True) == "stop"
    assert finish_reason_of("abort", False) == "abort"


@pytest.mark.parametrize("max_tokens,knobs,expected", [
    (100, {}, 128), (32, {}, 32), (20, {}, 20), (33, {}, 64), (10, {"block_length": 8}, 16),
    (50, {"policy": "dream-entropy"}, 50),
])
def test_max_tokens_rounds_up_to_whole_blocks(max_tokens, knobs, expected):
    assert canvas_for_max_tokens(max_tokens, knobs) == expected


@pytest.mark.parametrize("knobs,room,expected", [
    ({}, 1000, 128), ({}, 100, 96), ({}, 20, 20), ({"block_length": 8}, 100, 96), ({"block_length": 64}, 40, 128),
    ({"policy": "dream-entropy"}, 50, 50), ({"gen_length": 64}, 64, 64), ({"block_length": None}, 100, 96),
])
def test_the_default_canvas_is_whole_blocks_that_fit_the_context_left(knobs, room, expected):
    assert canvas_within(knobs, room) == expected


def test_ids_are_unique_whatever_the_global_random_state_and_across_a_fork():
    random.seed(0)  # a request's `seed` must not make ids repeat
    first = new_id("cmpl")
    random.seed(0)
    assert new_id("cmpl") != first and first.startswith("cmpl-") and len(first) == len("cmpl-") + 32
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only reports its next id
        os.write(write, new_id("x").encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    assert child != new_id("x")


class _LeavingClient:
    """A request whose client has gone; counts how often the server asked."""

    def __init__(self) -> None:
        self.asked = 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return True


def test_a_client_that_left_is_seen_within_the_poll_interval_even_while_events_keep_coming():
    client, now = _LeavingClient(), [0.0]
    watch = DisconnectWatch(client, clock=lambda: now[0])  # type: ignore[arg-type]

    async def looks(times: list[float]) -> list[bool]:
        seen = []
        for t in times:  # one look per event, as the output loop makes
            now[0] = t
            seen.append(await watch.gone())
        return seen

    inside = [i * DISCONNECT_POLL_SECONDS / 10 for i in range(10)]
    assert asyncio.run(looks(inside)) == [False] * 10 and client.asked == 0  # not asked per event
    assert asyncio.run(looks([DISCONNECT_POLL_SECONDS])) == [True] and client.asked == 1
