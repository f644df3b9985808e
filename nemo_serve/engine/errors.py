"""Errors the network side catches, importable without torch."""


class NoFreeSlotError(RuntimeError):
    """Every slot is held by an open stream."""
