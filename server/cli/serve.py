"""`cai-dllm serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from server.cli.args import ENGINE_FLAG_ALIASES, add_setting, engine_flag_options, exit_now, fail, json_list


def add_parser(sub: Any) -> None:
    from server.cli.args import threads_default
    from server.settings import LOG_LEVELS

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the bundled llada-tiny on CPU)",
                           description="Every option can also be set as CAI_DLLM_<OPTION> in the environment.")
    engine = serve.add_argument_group("engine")
    add_setting(engine, "model", help="local checkpoint directory")
    aliases = {"max_batch": ("--max-num-seqs",), "quantization": ("-q",), **ENGINE_FLAG_ALIASES}
    for name, options in engine_flag_options().items():
        unset = {"unset": threads_default()} if name == "threads" else {}
        add_setting(engine, name, *aliases.get(name, ()), **options, **unset)
    add_setting(engine, "max_model_len", type=int, help="prompt + canvas limit", unset="the model's context")
    add_setting(engine, "use_flash_attn", action=argparse.BooleanOptionalAction,
                 help="FlashAttention kernels", unset="when installed and usable")
    add_setting(engine, "max_logprobs", type=int, help="most top logprobs a request may ask for per token")
    add_setting(engine, "max_score_tokens", type=int,
                help="most tokens one likelihood-scoring request (echo + logprobs) may feed the model; the "
                     "default is what the bundled model scores within the 60 s --stall-timeout on a 2-core CPU "
                     "(about 40 s at the 13 k tokens/s of bench/score_variance.py chunks)")
    add_setting(engine, "score_chunk_tokens", type=int,
                help="most tokens one scoring forward feeds the model; a scoring request runs as such chunks "
                     "between decode steps, so a step waits on one at most")
    add_setting(engine, "cuda_graphs", action=argparse.BooleanOptionalAction,
                 help="run the cached steps (masked dual/prefix, block-diffusion, uniform-noise decoder) as CUDA "
                      "graphs, one per batch bucket "
                      "(CUDA only; --no-cuda-graphs or --enforce-eager: eager steps)",
                 unset="on for CUDA at --tensor-parallel-size 1")
    add_setting(engine, "torch_compile", action=argparse.BooleanOptionalAction,
                help="compile the cached steps (masked dual/prefix, block-diffusion, uniform-noise passes) with "
                     "torch.compile(fullgraph=True), once per shape met (the first step of a shape waits for its "
                     "compile; docs/performance.md)")
    engine.add_argument("--enforce-eager", dest="cuda_graphs", action="store_false", default=None,
                        help="vLLM's name for --no-cuda-graphs")
    add_setting(engine, "enable_prefix_caching", action=argparse.BooleanOptionalAction,
                help="reuse the keys and values of prompt blocks computed for earlier requests (block-diffusion "
                     "models and DiffusionGemma; refused for masked-diffusion ones, docs/server.md)",
                unset="on for block-diffusion models and DiffusionGemma")
    add_setting(engine, "prefix_cache_gb", type=float, help="device memory the prefix cache may hold, GiB (per rank)",
                unset="a tenth of the device's memory")
    add_setting(engine, "distributed_timeout", type=float,
                help="with --tensor-parallel-size: seconds a rank may wait on another (a collective, a heartbeat) "
                     "before the server fails /health and exits")
    sv = serve.add_argument_group("server")
    add_setting(sv, "served_model_name", help="the model id clients send", unset="the directory name")
    add_setting(sv, "host", help="address to listen on")
    add_setting(sv, "port", type=int, help="port to listen on")
    add_setting(sv, "max_queue", type=int, help="requests waiting for a row (after the free rows are filled) "
                                                "before 429")
    add_setting(sv, "max_n", type=int, help="completions per request, n x prompts")
    add_setting(sv, "max_decode_steps", type=int, help="most decode steps one choice may take (its decoding.steps, "
                "by default one per canvas token); a request over it gets a 400", unset="no cap")
    add_setting(sv, "api_key", help="require 'Authorization: Bearer KEY' on /v1 routes", unset="no key")
    add_setting(sv, "default_decoding", help="JSON object of default decoding knobs, e.g. "
                 "'{\"cache\": \"dual\"}'", unset="the model's defaults")
    add_setting(sv, "request_timeout", type=float, help="seconds")
    add_setting(sv, "shutdown_timeout", type=float, help="seconds to finish in-flight work on SIGTERM")
    add_setting(sv, "stall_timeout", type=float, help="/health fails after this many seconds without progress")
    add_setting(sv, "log_level", choices=LOG_LEVELS, help="uvicorn's log level")
    add_setting(sv, "allowed_origins", type=json_list,
                 help='JSON list of origins allowed to call the API from a browser (CORS), e.g. \'["*"]\'',
                 unset="none: CORS off")
    add_setting(sv, "decoding_profiles", "--decoding-profile", action="append", metavar="FILE",
                 help="a decoding profile file (cai-dllm calibrate writes one); the first is every request's "
                      "default, any can be named by a request as decoding.profile; repeat for several",
                 unset="none: the paper's defaults")
    add_setting(sv, "chat_template", help="a Jinja chat template file (or the template itself) used instead of "
                                           "the checkpoint's", unset="the checkpoint's")
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import threading

    import uvicorn

    from server.app import create_app, drain
    from server.settings import load_settings, setting_names

    flags = {name: getattr(args, name, None) for name in setting_names()}  # a few are variables only
    try:
        settings = load_settings(flags)
        from engine.decoding import DecodeParams

        DecodeParams.from_dict(settings.default_decoding)
        from engine.decoding.profiles import load_profile, profile_table

        profile_table(load_profile(path) for path in settings.decoding_profiles)
    except ValueError as err:
        return fail(err)
    taken = _port_refusal(settings.host, settings.port)
    if taken is not None:  # before loading anything: a one-line error, not a model load and a traceback
        print(f"error: cannot listen on {settings.host}:{settings.port}: {taken}", file=sys.stderr)
        return 1
    load_failure: list[str] = []

    def end_on_load_failure(reason: str) -> None:  # a server that cannot serve should not look alive
        load_failure.append(reason)
        server.should_exit = True

    engine_fault: list[str] = []

    def end_on_engine_fault(reason: str) -> None:  # every request in flight has failed; /health says why
        engine_fault.append(reason)
        threading.Timer(_FAULT_LINGER_SECONDS, lambda: setattr(server, "should_exit", True)).start()

    app = create_app(settings, on_load_failure=end_on_load_failure, on_engine_fault=end_on_engine_fault)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: answer 503 to new work, finish what is in flight (up to
        --shutdown-timeout), then exit 0."""

        def handle_exit(self, sig: int, frame: Any) -> None:  # type: ignore[override]
            if getattr(self, "_draining", False):
                return super().handle_exit(sig, frame)
            self._draining = True

            async def finish() -> None:
                await drain(app, settings.shutdown_timeout)
                self.should_exit = True

            asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(finish()))

    # drain() has waited the shutdown timeout and answered what was left: uvicorn only closes sockets
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=_CLOSE_SECONDS)
    server = DrainingServer(config)
    try:
        server.run()
    except SystemExit:  # uvicorn could not bind after all (it has logged why)
        exit_now(1)
    if load_failure:
        print(f"error: {load_failure[0]}", file=sys.stderr)
        exit_now(1)
    if engine_fault:
        print(f"error: the engine failed: {engine_fault[0]}", file=sys.stderr)
        exit_now(1)
    return 0


_CLOSE_SECONDS = 5  # after the drain, for uvicorn to close the connections
# after an engine fault, how long /health keeps answering 503 with the reason before the process
# exits 1: a probe at kubelet's shortest period (1 s) reads it once
_FAULT_LINGER_SECONDS = 1.0


def _port_refusal(host: str, port: int) -> Optional[str]:
    """Why (host, port) cannot be listened on, or None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as err:
        return err.strerror or str(err)
    return None
