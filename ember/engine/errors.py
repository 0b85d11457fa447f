"""Engine errors, each mapping to one gRPC status at the service edge."""


class InvalidRequestError(ValueError):
    """The request itself is wrong (INVALID_ARGUMENT)."""


class CapacityError(RuntimeError):
    """The request can never fit this engine's KV pool (RESOURCE_EXHAUSTED)."""


class IntegrityError(ValueError):
    """Imported KV does not match the tokens or layout it claims (DATA_LOSS)."""
