"""Package attributes imported on first use (PEP 562), so that importing a light module of a
package (the settings, the decoding parameters) does not import torch through its `__init__`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` (a module path) for `name` once and
    keeps the value in the package's `namespace`."""

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    return getattr_
