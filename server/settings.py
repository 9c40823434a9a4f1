"""Server settings: one frozen dataclass, filled from command-line flags, then environment
variables (`CAI_DLLM_<NAME>`), then defaults. This is the only place the environment is read.

The engine's own settings are an `EngineConfig` inside (`settings.engine`), passed to the engine
as is; their names (`model`, `device`, `max_batch`, ...) are flags and variables like the rest."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

from engine.bundled import BUNDLED_DIR
from engine.config import EngineConfig

ENV_PREFIX = "CAI_DLLM_"
BUNDLED_MODEL = BUNDLED_DIR / "llada-tiny"
_MAX_PORT = 65535
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def default_engine() -> EngineConfig:
    """The engine served when nothing is configured: the bundled model, EngineConfig's defaults."""
    return EngineConfig(model=str(BUNDLED_MODEL))


@dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig = field(default_factory=default_engine)
    served_model_name: Optional[str] = None  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64  # requests waiting for a row; beyond it: 429
    max_n: int = 16  # completions per request (n x prompts)
    # the most decode steps one choice may take (server/request_cost.py); None: no cap
    max_decode_steps: Optional[int] = None
    max_body_bytes: int = 1 << 20
    api_key: Optional[str] = None
    default_decoding: dict[str, Any] = field(default_factory=dict)
    request_timeout: float = 600.0
    shutdown_timeout: float = 30.0
    stall_timeout: float = 60.0  # /health fails when work is pending and no step finished for this long
    log_level: str = "info"
    # origins allowed to call the API from a browser (CORS); empty: no CORS headers at all. vLLM
    # allows every origin by default; here a browser origin must be named (or "*")
    allowed_origins: list[str] = field(default_factory=list)
    # a Jinja chat template (a file, or the template itself) in place of the checkpoint's
    chat_template: Optional[str] = None
    # decoding profile files (`cai-dllm calibrate` writes them): the first is every request's
    # default, each can be named by a request (`decoding.profile`)
    decoding_profiles: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {self.engine!r}")
        if not _is_int(self.port) or not 0 <= self.port <= _MAX_PORT:
            raise ValueError(f"port must be an integer from 0 to {_MAX_PORT}, got {self.port!r}")
        for name in ("max_queue", "max_n", "max_body_bytes", "max_decode_steps"):
            value = getattr(self, name)
            if (value is not None or name != "max_decode_steps") and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("request_timeout", "shutdown_timeout", "stall_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not isinstance(self.allowed_origins, list) or not all(isinstance(o, str) for o in self.allowed_origins):
            raise ValueError("allowed_origins must be a JSON list of strings, e.g. [\"http://localhost:3000\"]")
        if not isinstance(self.decoding_profiles, list) or not all(isinstance(p, str) for p in self.decoding_profiles):
            raise ValueError("decoding_profiles must be a JSON list of file paths")
        if not isinstance(self.default_decoding, dict):
            raise ValueError("default_decoding must be a JSON object")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name

    def chat_template_text(self) -> Optional[str]:
        """The --chat-template override: a file's contents, or the value itself when it is a
        template (vLLM's rule); ValueError when it is neither."""
        value = self.chat_template
        if value is None:
            return None
        path = Path(value)
        if path.is_file():
            return path.read_text(encoding="utf-8")
        if "{{" in value or "{%" in value:
            return value
        raise ValueError(f"chat_template: no such file, and not a Jinja template: {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _server_fields() -> tuple[Field, ...]:
    return tuple(f for f in fields(ServerSettings) if f.name != "engine")


def setting_names() -> tuple[str, ...]:
    """Every setting's name, the engine's first: flags `--<name>`, variables `CAI_DLLM_<NAME>`."""
    return tuple(f.name for f in (*fields(EngineConfig), *_server_fields()))


def setting_default(name: str) -> Any:
    """The value a setting takes when neither a flag nor a variable gives one."""
    if name in {f.name for f in fields(EngineConfig)}:
        return getattr(default_engine(), name)
    for f in _server_fields():
        if f.name == name:
            return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
    raise KeyError(name)


def _convert(name: str, raw: str, kind: str) -> Any:
    if "dict" in kind or "list" in kind:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {err}") from None
    if "bool" in kind:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be true or false, got {raw!r}")
    if "int" in kind:
        return int(raw)
    if "float" in kind:
        return float(raw)
    return raw


def _gather(of: Iterable[Field], overrides: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in of:
        given = overrides.get(f.name)
        if given is not None:
            values[f.name] = given
            continue
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None and raw != "":
            values[f.name] = _convert(f.name, raw, str(f.type))
    return values


def load_settings(overrides: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> ServerSettings:
    """`overrides` (flags; None = not given) win over `CAI_DLLM_*` variables, which win over defaults.
    Engine settings go by their own names (`model`, `max_batch`, ...), like the server's."""
    environ = os.environ if environ is None else environ
    engine = replace(default_engine(), **_gather(fields(EngineConfig), overrides, environ))
    values = _gather(_server_fields(), overrides, environ)
    for name in ("default_decoding", "allowed_origins", "decoding_profiles"):
        if isinstance(values.get(name), str):
            values[name] = _convert(name, values[name], "dict")
    return ServerSettings(engine=engine, **values)
