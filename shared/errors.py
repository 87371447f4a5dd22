"""Typed errors for everything AFlex can refuse or fail at.

Each error carries a message that says what was wrong and where, so that a service can turn it
into an HTTP 400 / typed rejection without a traceback, and an operator can act on it.
"""

from __future__ import annotations


class AFlexError(Exception):
    """Base of every error AFlex raises on purpose."""


class CheckpointError(AFlexError):
    """A checkpoint cannot be used: unreadable file, unknown layout or metadata."""


class UnknownArchitectureError(CheckpointError):
    """The checkpoint's architecture is not one AFlex implements."""

    def __init__(self, architecture: str, source: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            f"unknown architecture {architecture!r} in {source}; supported: {', '.join(supported)}"
        )
        self.architecture = architecture
        self.source = source


class MissingTensorError(CheckpointError):
    """A tensor the model needs is absent from the checkpoint."""

    def __init__(self, name: str, source: str) -> None:
        super().__init__(f"tensor {name!r} is missing from {source}")
        self.name = name
        self.source = source


class TensorShapeError(CheckpointError):
    """A tensor in the checkpoint has a shape other than the config implies."""

    def __init__(self, name: str, expected: tuple[int, ...], found: tuple[int, ...], source: str) -> None:
        super().__init__(
            f"tensor {name!r} in {source} has shape {list(found)}, expected {list(expected)}"
        )
        self.name = name
        self.expected = expected
        self.found = found
        self.source = source


class DeviceError(AFlexError):
    """A torch device that does not exist or is not available here."""


class TokenizerError(AFlexError):
    """Text was asked for but the checkpoint has no usable tokenizer or chat template."""


class KVCacheExhaustedError(AFlexError):
    """No free KV blocks are left: the scheduler should preempt or queue the sequence."""

    def __init__(self, needed_blocks: int, free_blocks: int) -> None:
        super().__init__(f"KV cache exhausted: {needed_blocks} blocks needed, {free_blocks} free")
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class InvalidRequestError(AFlexError):
    """A request's parameters are invalid (bad sampling values, prompt too long, ...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
