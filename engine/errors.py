"""Exceptions the engine raises for problems a user can fix (bad checkpoint, bad device)."""


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, names an unknown architecture or has a bad weight."""


class DeviceError(ValueError):
    """The requested device or dtype cannot be used on this machine."""
