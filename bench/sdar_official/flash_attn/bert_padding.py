"""Names the official SDAR model imports inside a `try:` and never calls at inference."""

from typing import Any


def _absent(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("not on the official SDAR inference path; the CPU stand-in lacks it")


index_first_axis = pad_input = unpad_input = _absent
