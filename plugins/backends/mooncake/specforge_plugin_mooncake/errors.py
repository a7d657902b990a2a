"""Exception types of the ``mooncake`` feature store."""

from specforge_core.errors import FeatureStoreError

__all__ = ["MooncakeUnavailableError"]


class MooncakeUnavailableError(FeatureStoreError):
    """The Mooncake client cannot be loaded, or its master or metadata server cannot be reached."""
