"""Exception types of the ``hf`` target engine and the toy target."""

from specforge_core.errors import SpecforgeError, TargetEngineError

__all__ = ["CapturePlanError", "TargetEngineError", "TargetModelNotFoundError", "ToyTargetError"]


class TargetModelNotFoundError(TargetEngineError):
    """The target model folder (or hub id) does not exist."""


class CapturePlanError(TargetEngineError, ValueError):
    """A capture plan asks for layers the target does not have."""


class ToyTargetError(SpecforgeError):
    """The toy target cannot be built where it was asked to be."""
