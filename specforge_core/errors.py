"""Exception types. Every message says what went wrong and what to do next."""


class SpecforgeError(Exception):
    """Base class of every error specforge raises on purpose."""


class PluginError(SpecforgeError):
    """A plugin could not be loaded, validated or called."""


class PluginConflictError(PluginError):
    """Two plugins claim the same component name or the same entry point name."""


class UnknownComponentError(SpecforgeError):
    """A component name (strategy, target engine, ...) that no active plugin provides."""


class CapabilityError(SpecforgeError):
    """A strategy needs something the chosen target engine (or store) cannot provide."""


class OptionError(SpecforgeError):
    """An unknown option key or a value of the wrong form."""


class RecordError(SpecforgeError):
    """A metadata record is malformed, or carries a tensor where only metadata belongs."""


class FeatureStoreError(SpecforgeError):
    """Base class of feature store failures."""


class SampleNotFoundError(FeatureStoreError):
    """The sample was released, aborted or never stored."""


class StaleRefError(FeatureStoreError):
    """The ref names an older generation of a sample that has been re-put since."""


class CorruptFeatureError(FeatureStoreError):
    """A stored feature file is truncated, corrupt, or does not match its ref."""


class StoreFullError(FeatureStoreError):
    """Storing the sample would exceed the store's resident-bytes cap."""


class ControlPlaneError(SpecforgeError):
    """Base class of control-plane failures."""


class ChannelFailedError(ControlPlaneError):
    """The producer marked the ref channel as failed."""


class ChannelClosedError(ControlPlaneError):
    """Publishing on a channel that was already closed or failed."""


class ChannelTimeoutError(ControlPlaneError):
    """The consumer waited longer than its idle timeout without a new ref."""


class ChannelCorruptError(ControlPlaneError):
    """A line of the channel file is not a valid record."""


class UnknownFeatureError(FeatureStoreError, KeyError):
    """A feature name the sample does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TargetEngineError(SpecforgeError):
    """A target engine could not load its model, or a request to it is malformed."""


class LeaseHeldError(ControlPlaneError):
    """A lease (a stream's producer setup, a consumer rank) is held by another live process."""


class ClaimLostError(ControlPlaneError):
    """A producer's claim expired and another producer took it before it was completed."""


class StrategyContractError(PluginError):
    """A strategy's collate or forward_loss returned something the trainer cannot use."""


class NonFiniteTrainingError(SpecforgeError):
    """A step's gradients (or loss) are not finite: training stopped before the update reached the weights."""
