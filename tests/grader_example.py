"""A grader given to `cai-dllm calibrate --grader grader_example:last_value` in the tests."""

from __future__ import annotations

from typing import Any


def last_value(response: str, item: dict[str, Any]) -> bool:
    return response.rsplit("=", 1)[-1].strip() == item["answer"]
