"""Decoding profiles: the file format, and a profile's round trip through a real server (as every
request's default, by name, listed in /v1/models and the OpenAPI document, refused when unknown)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from serverproc import REPO, running_server

from engine import Engine, EngineConfig
from engine.decoding.profiles import (
    PAPER_PROFILE,
    DecodingProfile,
    ProfileError,
    load_profile,
    profile_table,
    save_profile,
)


def test_profile_file_round_trip(tmp_path):
    profile = DecodingProfile("calibrated", {"policy": "cai", "theta_s": 0.8, "gating": False}, model="llada-tiny",
                              validation={"accuracy": 0.9, "nfe_per_request": 12.5, "data_sha256": "ab" * 32})
    save_profile(profile, tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")
    assert (loaded.name, loaded.decoding, loaded.model, loaded.validation) == (
        profile.name, profile.decoding, profile.model, profile.validation)
    assert loaded.source == str(tmp_path / "p.json")


@pytest.mark.parametrize(("content", "says"), [
    ("{not json", "not valid JSON"),
    ("[]", "'name' and 'decoding'"),
    (json.dumps({"name": "x", "decoding": {"theta_s": 2.0}}), "theta_s"),
    (json.dumps({"name": "x", "decoding": {"nonsense": 1}}), "nonsense"),
    (json.dumps({"name": "x", "decoding": {"gen_length": 64}}), "gen_length belongs to the request"),
    (json.dumps({"name": "x", "decoding": {"seed": 1}}), "seed belongs to the request"),
    (json.dumps({"name": "has space", "decoding": {}}), "profile name"),
    (json.dumps({"format": 9, "name": "x", "decoding": {}}), "format"),
])
def test_bad_profile_files_are_refused_with_the_reason(tmp_path, content, says):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=says):
        load_profile(path)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_profile_table_has_the_paper_defaults_and_refuses_duplicates():
    table = profile_table([DecodingProfile("a", {"policy": "fixed"})])
    assert list(table) == [PAPER_PROFILE, "a"]
    with pytest.raises(ProfileError, match="two decoding profiles"):
        profile_table([DecodingProfile("a", {}), DecodingProfile("a", {})])
    with pytest.raises(ProfileError, match="two decoding profiles"):
        profile_table([DecodingProfile(PAPER_PROFILE, {})])


def test_serve_refuses_a_bad_profile_before_loading(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "decoding": {"gen_length": 64}}))
    run = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--decoding-profile", str(bad)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [f"error: {bad}: profile 'x': gen_length belongs to the request, "
                                               "not a profile"]


def test_profile_round_trip_through_the_server(tmp_path):
    # a profile unlike the paper's: every step of the canvas, no early exit
    slow = DecodingProfile("slow", {"policy": "fixed", "early_exit": False})
    save_profile(slow, tmp_path / "slow.json")
    save_profile(DecodingProfile("fast", {"policy": "threshold", "threshold": 0.5}), tmp_path / "fast.json")
    with running_server("--decoding-profile", str(tmp_path / "slow.json"),
                        "--decoding-profile", str(tmp_path / "fast.json")) as (base, _):
        [card] = httpx.get(f"{base}/v1/models").json()["data"]
        assert card["decoding_profiles"] == [PAPER_PROFILE, "slow", "fast"]
        assert card["default_decoding_profile"] == "slow"
        schema = httpx.get(f"{base}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        [decoding] = [b for b in schema["properties"]["decoding"]["anyOf"] if b.get("type") == "object"]
        assert decoding["properties"]["profile"]["enum"] == [PAPER_PROFILE, "slow", "fast"]

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")

        def nfe(**decoding) -> int:
            extra = {"decoding": decoding} if decoding else None
            reply = client.completions.create(model=card["id"], prompt="00457+00038", max_tokens=64, extra_body=extra)
            return reply.choices[0].model_extra["decoding"]["nfe"]

        assert nfe() == 64  # the default profile: every step of a 64-token canvas
        assert nfe(profile="slow") == 64
        assert nfe(profile=PAPER_PROFILE) < 64  # CAI with early exit
        assert nfe(profile="fast") < 64
        # the request's own knobs go over the profile's
        assert nfe(profile="slow", steps=32) == 32
        with pytest.raises(openai.BadRequestError) as refused:
            nfe(profile="nope")
        error = refused.value.body
        assert error["param"] == "decoding.profile" and error["code"] == "unknown_profile"
        assert "slow" in error["message"]


def test_profiles_from_flags_and_environment():
    from server.cli import build_parser
    from server.settings import load_settings

    args = build_parser().parse_args(["serve", "--decoding-profile", "a.json", "--decoding-profile", "b.json"])
    assert load_settings({"decoding_profiles": args.decoding_profiles}, environ={}).decoding_profiles == [
        "a.json", "b.json"]
    environ = {"CAI_DLLM_DECODING_PROFILES": '["c.json"]'}
    assert load_settings({}, environ=environ).decoding_profiles == ["c.json"]
    with pytest.raises(ValueError, match="decoding_profiles"):
        load_settings({}, environ={"CAI_DLLM_DECODING_PROFILES": '{"a": 1}'})


def test_the_committed_calibrated_profile_loads_and_its_knobs_are_valid_for_the_model():
    profile = load_profile(REPO / "models" / "llada-tiny" / "calibrated_profile.json")
    engine = Engine(EngineConfig(model=str(REPO / "models" / "llada-tiny")))
    engine.default_params().with_overrides(**profile.decoding, gen_length=128)  # raises on a bad knob
    validation = profile.validation
    assert profile.name == "calibrated" and validation["grader"] == "builtin" and validation["items"] == 300
    assert len(validation["data_sha256"]) == 64 and validation["trials"]
    # what docs/cai.md reports of it
    assert validation["feasible"] is False and round(100 * validation["accuracy"], 1) == 95.3
