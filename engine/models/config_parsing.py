"""What every family's `parse_config` shares: refusing unsupported config values, turning a missing
or malformed field into a `CheckpointError` that names it, and the Hugging Face transformer sizes
that Qwen-style configs (Dream, SDAR, LLaDA2) spell the same way."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from engine.errors import CheckpointError


def refuse_unsupported(family: str, hf: Mapping[str, Any], unsupported: Mapping[str, bool]) -> None:
    """`unsupported` maps a config key to whether its value is one we cannot run."""
    for key, bad in unsupported.items():
        if bad:
            raise CheckpointError(f"{family} config field {key}={hf.get(key)!r} is not supported")


@contextmanager
def config_errors(family: str) -> Iterator[None]:
    """A missing key or a value of the wrong type in config.json, as a `CheckpointError`."""
    try:
        yield
    except KeyError as err:
        raise CheckpointError(f"{family} config.json is missing the field {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{family} config.json is invalid: {err}") from None


def hf_sizes(hf: Mapping[str, Any]) -> dict[str, int]:
    """ModelConfig's size fields from the standard Hugging Face names (KV heads default to the heads)."""
    heads = int(hf["num_attention_heads"])
    return {"hidden_size": int(hf["hidden_size"]), "num_layers": int(hf["num_hidden_layers"]),
            "num_heads": heads, "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "intermediate_size": int(hf["intermediate_size"]), "vocab_size": int(hf["vocab_size"])}
