"""Exception types of the ``hf`` target engine and the toy target."""

from specforge_core.errors import SpecforgeError, TargetEngineError

__all__ = [
    "AttentionImplementationError", "CapturePlanError", "TargetEngineError", "TargetModelNotFoundError",
    "ToyTargetError",
]


class TargetModelNotFoundError(TargetEngineError):
    """The target model folder (or hub id) does not exist."""


class AttentionImplementationError(TargetEngineError):
    """The chosen attention implementation cannot run the target model (or on its device)."""


class CapturePlanError(TargetEngineError, ValueError):
    """A capture plan asks for layers the target does not have."""


class ToyTargetError(SpecforgeError):
    """The toy target cannot be built where it was asked to be."""


class RealModelError(SpecforgeError):
    """The real test model (SmolLM2-135M-Instruct from its PyPI wheel) cannot be fetched or converted."""
