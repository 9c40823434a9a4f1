"""Server settings: one frozen dataclass, filled from command-line flags, then environment
variables (`CAI_DLLM_<NAME>`), then defaults. This is the only place the environment is read."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

ENV_PREFIX = "CAI_DLLM_"
BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "models" / "llada-tiny"


@dataclass(frozen=True)
class ServerSettings:
    model: str = str(BUNDLED_MODEL)
    served_model_name: Optional[str] = None  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 8
    max_queue: int = 64  # requests waiting for a row; beyond it: 429
    max_model_len: Optional[int] = None  # prompt + canvas; default: the model's context
    max_n: int = 16  # completions per request (n x prompts)
    max_body_bytes: int = 1 << 20
    api_key: Optional[str] = None
    default_decoding: dict[str, Any] = field(default_factory=dict)
    request_timeout: float = 600.0
    shutdown_timeout: float = 30.0
    stall_timeout: float = 60.0  # /health fails when work is pending and no step finished for this long
    # the longest the next step is held, after a step frees rows, for the requests that will fill
    # them; within it the wait adapts to the step time and to how soon freed rows were refilled
    # lately (server/admission.py), so open-loop load does not wait; 0 turns it off
    admission_wait_ms: float = 5.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("port", "max_batch", "max_queue", "max_n", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "port" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("request_timeout", "shutdown_timeout", "stall_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.admission_wait_ms < 0:
            raise ValueError(f"admission_wait_ms must be >= 0, got {self.admission_wait_ms!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not isinstance(self.default_decoding, dict):
            raise ValueError("default_decoding must be a JSON object")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


def _convert(name: str, raw: str, kind: str) -> Any:
    if "dict" in kind:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {err}") from None
    if "int" in kind:
        return int(raw)
    if "float" in kind:
        return float(raw)
    return raw


def load_settings(overrides: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> ServerSettings:
    """`overrides` (flags; None = not given) win over `CAI_DLLM_*` variables, which win over defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(ServerSettings):
        given = overrides.get(f.name)
        if given is not None:
            values[f.name] = given
            continue
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None and raw != "":
            values[f.name] = _convert(f.name, raw, str(f.type))
    if isinstance(values.get("default_decoding"), str):
        values["default_decoding"] = _convert("default_decoding", values["default_decoding"], "dict")
    return ServerSettings(**values)
