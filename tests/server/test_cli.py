"""`cai-dllm inspect` run as a user runs it: the installed console script, in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _cli() -> list[str]:
    script = shutil.which("cai-dllm", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "server.cli"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli(), *args], capture_output=True, text=True, timeout=120)


def test_inspect_tiny_checkpoint(fixtures):
    out = _run("inspect", str(fixtures / "llada_tiny"))
    assert out.returncode == 0, out.stderr
    mask_id = json.loads((fixtures / "llada_tiny" / "config.json").read_text())["mask_token_id"]
    assert "LLaDA" in out.stdout and "float32" in out.stdout and f"'mask': {mask_id}" in out.stdout


def test_inspect_json_on_real_metadata(fixtures):
    out = _run("inspect", "--json", str(fixtures / "real" / "dream-v0-instruct-7b"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["architecture"] == "Dream"
    assert report["parameters"] == 7_615_616_512
    assert report["special_ids"] == {"mask": 151666, "eos": [151643], "eot": 151645, "pad": 151643,
                                     "bos": 151643}
    assert report["chat_template"] is True
    assert report["dtype"] == "bfloat16"
    assert report["weights"]["status"].startswith("not loadable")  # the index has no shard files here


@pytest.mark.parametrize("target", ["missing-dir", "file"])
def test_inspect_bad_path_is_a_clear_error(tmp_path, target):
    path = tmp_path / "x"
    if target == "file":
        path.write_text("")
    out = _run("inspect", str(path))
    assert out.returncode == 2
    assert "error:" in out.stderr and "Traceback" not in out.stderr


def _plain_llada_golden_run(fixtures: Path) -> dict:
    """A batch-1 run of the official LLaDA `generate()` with several blocks, no guidance, no padding."""
    for path in sorted((fixtures / "golden").glob("llada_generate_*.json")):
        run = json.loads(path.read_text())
        settings = run["settings"]
        if len(run["prompt_ids"]) == 1 and not settings.get("cfg_scale") and settings.get("attention_mask") is None \
                and settings["block_length"] < settings["gen_length"]:
            return run
    raise AssertionError("no batch-1 multi-block LLaDA generate() run among the golden files")


def test_generate_json_reproduces_llada_golden(fixtures):
    golden = _plain_llada_golden_run(fixtures)
    settings = golden["settings"]
    ids = ",".join(map(str, golden["prompt_ids"][0]))
    out = _run("generate", "--model", str(fixtures / "llada_tiny"), "--prompt-ids", ids, "--prompt-ids", "1,2,3",
               "--policy", "fixed", "--gen-length", str(settings["gen_length"]),
               "--block-length", str(settings["block_length"]), "--steps", str(settings["steps"]),
               "--no-early-exit", "--json")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(records) == 2
    assert records[0]["generated_ids"] == golden["generated_ids"][0]
    blocks = settings["gen_length"] // settings["block_length"]
    assert records[0]["nfe"] == golden["nfe"] == settings["steps"]
    assert records[0]["steps_per_block"] == [settings["steps"] // blocks] * blocks
    assert {"text", "finish_reason", "steps_saved"} <= set(records[0])


def _char_tokenizer_checkpoint(fixtures: Path, dest: Path) -> None:
    """The tiny LLaDA fixture with the built-in character tokenizer and its chat template."""
    from tinymodels.char_tokenizer import write_tokenizer_files

    shutil.copytree(fixtures / "llada_tiny", dest)
    write_tokenizer_files(dest)


def test_generate_text_and_chat_prompts(fixtures, tmp_path):
    _char_tokenizer_checkpoint(fixtures, tmp_path / "m")
    out = _run("generate", "--model", str(tmp_path / "m"), "--prompt", "hello", "--prompt", "2+2=",
               "--chat", "--gen-length", "16", "--block-length", "8", "--json")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    from tinymodels.char_tokenizer import USER, special_id

    assert [r["prompt_ids"][0] for r in records] == [special_id(USER)] * 2  # the chat template's user tag
    assert all(isinstance(r["text"], str) for r in records)
    plain = _run("generate", "--model", str(tmp_path / "m"), "--prompt", "hi", "--gen-length", "8")
    assert plain.returncode == 0, plain.stderr
    assert "NFE" in plain.stdout


def test_generate_bad_knob_names_it(fixtures):
    out = _run("generate", "--model", str(fixtures / "llada_tiny"), "--prompt-ids", "1,2", "--theta-s", "2")
    assert out.returncode == 2
    assert "theta_s" in out.stderr and "Traceback" not in out.stderr


def test_generate_text_without_tokenizer_is_an_error(fixtures):
    out = _run("generate", "--model", str(fixtures / "llada_tiny"), "--prompt", "hello")
    assert out.returncode == 2 and "tokenizer" in out.stderr


def test_score_ranks_continuations_with_the_engines_numbers():
    model = Path(__file__).resolve().parents[2] / "models" / "llada-tiny"
    right = "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000495"
    wrong = "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000595"
    out = _run("score", "--model", str(model), "--chat", "--context", "00457+00038", "--continuation", right,
               "--continuation", wrong, "--samples", "4", "--seed", "3", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert rows[0]["logprob"] > rows[1]["logprob"] and rows[0]["tokens"] == len(right)

    from engine import Engine, EngineConfig
    from engine.chat import chat_prompt_ids

    engine = Engine(EngineConfig(model=str(model)))
    context = chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": "00457+00038"}])
    ids = context + engine.tokenizer.encode(right, add_special_tokens=False)
    assert rows[0]["token_logprobs"] == pytest.approx(engine.score(ids, 4, seed=3)[len(context):], abs=1e-9)
    bad = _run("score", "--model", str(model), "--context", "x", "--continuation", "y", "--samples", "0")
    assert bad.returncode == 2 and "score_samples" in bad.stderr


def test_help_does_not_wait_for_torch_and_every_option_says_what_it_does():
    # --help used to take 3-7 s: torch was imported before the arguments were parsed
    probe = subprocess.run([sys.executable, "-c", "import sys, server.cli as c; c.build_parser(); "
                            "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[2])
    assert probe.returncode == 0 and probe.stdout.strip() == "False", probe.stderr

    import argparse

    from server.cli import build_parser
    from server.cli.args import DefaultsFormatter

    def options(parser: argparse.ArgumentParser, path: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from options(sub, f"{path} {name}")
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                yield path, action

    formatter = DefaultsFormatter("cai-dllm")
    for path, action in options(build_parser(), "cai-dllm"):
        assert action.help, f"{path} {action.option_strings or action.dest} has no help"
        shown = formatter._get_help_string(action)
        if action.option_strings and not action.required and action.default is not None:
            assert "default" in shown, f"{path} {action.option_strings} does not show its default"


def test_inspect_block_diffusion_checkpoints(fixtures, llada2_dir):
    """Both block families from the command line: the real SDAR-8B-Chat metadata (no weights here) and
    a complete random LLaDA2 MoE checkpoint (special ids from its generation config)."""
    sdar = _run("inspect", "--json", str(fixtures / "real" / "sdar-8b-chat"))
    assert sdar.returncode == 0, sdar.stderr
    report = json.loads(sdar.stdout)
    assert report["architecture"] == "SDAR" and report["block_size"] == 4 and report["parameters"] == 8_190_735_360
    assert "block-causal" in report["attention"] and report["special_ids"]["mask"] == 151669
    llada2 = _run("inspect", str(llada2_dir))
    assert llada2.returncode == 0, llada2.stderr
    assert "LLaDA2" in llada2.stdout and "'mask': 97" in llada2.stdout and "'status': 'ok'" in llada2.stdout
    hf = json.loads((llada2_dir / "config.json").read_text())  # the fixture's expert layout
    assert f"{hf['num_experts']} routed, {hf['num_experts_per_tok']} per token" in llada2.stdout


def test_every_cpu_command_takes_threads_with_serves_default():
    from server.cli import build_parser
    from server.cli.args import threads_default

    parser = build_parser()
    for argv in (["generate", "--model", "m", "--prompt", "p"], ["eval", "--model", "m"],
                 ["score", "--model", "m", "--context", "c", "--continuation", "x"], ["calibrate", "--model", "m"],
                 ["serve"]):
        assert parser.parse_args(argv).threads is None  # None: EngineConfig's default, serve's
        assert parser.parse_args([*argv, "--threads", "3"]).threads == 3
        sub = parser._subparsers._group_actions[0].choices[argv[0]]  # type: ignore[union-attr]
        (action,) = [a for a in sub._actions if "--threads" in a.option_strings]
        assert threads_default() in sub.formatter_class(argv[0])._get_help_string(action)


def test_openmp_wait_policy_is_set_once_before_torch():
    from server.cli.openmp import configure_openmp

    env: dict[str, str] = {}
    assert configure_openmp(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "active"}
    assert configure_openmp(env) == "active" and env == {"OMP_WAIT_POLICY": "active"}
    env = {"OMP_WAIT_POLICY": ""}  # asks for OpenMP's own default
    assert configure_openmp(env) is None and env == {}
    # the command line sets it before anything imports torch (which reads it when it loads OpenMP)
    probe = ("import os, sys\nfrom server.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n"
             "    pass\nprint(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.split()[-2:] == ["PASSIVE", "False"], done.stderr


@pytest.mark.parametrize("name", ["llada-tiny", "models/llada-tiny"])
def test_a_builtin_model_by_name_from_another_directory(tmp_path, name):
    """`--model llada-tiny` (or the repository-relative path) from a directory that has no such folder."""
    done = subprocess.run([*_cli(), "generate", "--model", name, "--prompt-ids", "1,2,3", "--gen-length", "8",
                           "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout.splitlines()[-1])["generated_ids"]) > 0


def test_a_missing_model_names_the_builtin_ones(tmp_path):
    from engine.bundled import bundled_names

    done = subprocess.run([*_cli(), "inspect", "no-such-model"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode != 0 and all(name in done.stderr for name in bundled_names())
