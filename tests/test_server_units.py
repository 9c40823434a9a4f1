"""Server pieces without HTTP: settings, energy meters (fake counters), stop strings, mappings."""

from __future__ import annotations

import os
import random

import pytest

from server.energy import EnergyMeter, NvmlMeter, RaplMeter, open_meter, share_energy
from server.protocol import new_id
from server.serving import Serving, apply_stop, finish_reason_of, safe_stream_length
from server.settings import BUNDLED_MODEL, load_settings


def test_settings_precedence_flags_env_defaults():
    env = {"CAI_DLLM_PORT": "9001", "CAI_DLLM_MAX_BATCH": "4", "CAI_DLLM_DEFAULT_DECODING": '{"cache": "dual"}',
           "CAI_DLLM_API_KEY": "k"}
    settings = load_settings({"port": 9100, "max_batch": None}, env)
    assert settings.port == 9100  # the flag wins
    assert settings.max_batch == 4  # then the environment
    assert settings.default_decoding == {"cache": "dual"} and settings.api_key == "k"
    assert settings.max_queue == 64  # then the default
    assert load_settings({}, {}).model == str(BUNDLED_MODEL)
    assert load_settings({}, {}).model_name == "llada-tiny"


@pytest.mark.parametrize("env", [{"CAI_DLLM_PORT": "x"}, {"CAI_DLLM_MAX_BATCH": "0"},
                                 {"CAI_DLLM_DEFAULT_DECODING": "{bad"}, {"CAI_DLLM_REQUEST_TIMEOUT": "-1"},
                                 {"CAI_DLLM_ADMISSION_WAIT_MS": "-1"}])
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
    assert apply_stop("a=12;b=3", [";"]) == ("a=12", True)
    assert apply_stop("abc", ["x", ""]) == ("abc", False)
    assert apply_stop("one two three", ["three", "two"]) == ("one ", True)
    # hold back a tail that might become a stop string; never hold back more than needed
    assert safe_stream_length("hello wor", ["world"]) == len("hello ")
    assert safe_stream_length("hello", ["xyz"]) == 5
    assert safe_stream_length("caf\ufffd", []) == 3


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
    assert Serving._canvas(max_tokens, knobs) == expected


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
