"""Exceptions the engine raises for problems a user can fix (bad checkpoint, device or request)."""

from typing import Optional


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, names an unknown architecture or has a bad weight."""


class DeviceError(ValueError):
    """The requested device or dtype cannot be used on this machine."""


class RequestError(ValueError):
    """A request the engine cannot take. `param` names the request field at fault (`prompt_ids` or
    `gen_length`); `code` is set for a context-length overflow."""

    def __init__(self, message: str, param: str = "prompt_ids", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class TensorParallelError(ValueError):
    """The model cannot be split across the requested number of ranks, or a rank failed to start."""


class SettingError(ValueError):
    """An engine-wide setting the model cannot take (a flag such as --enable-prefix-caching): the
    message opens with the flag, and a server reports it as the setting at fault, not a failed load."""

    def __init__(self, flag: str, reason: str) -> None:
        super().__init__(f"{flag}: {reason}")
        self.flag = flag
