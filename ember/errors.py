"""Ember's own error types, each mapping to one gRPC status at the service edge
(ember.rpc.errors.status_for). Anything else escaping a handler is a bug: INTERNAL, logged
with its traceback."""


class InvalidRequestError(ValueError):
    """The request itself is wrong (INVALID_ARGUMENT)."""


class CapacityError(RuntimeError):
    """No room for the request: a full queue, or more KV than the pool holds (RESOURCE_EXHAUSTED)."""


class IntegrityError(ValueError):
    """Bytes that do not match what they claim: KV against its tokens or layout (DATA_LOSS)."""


class NotFoundError(LookupError):
    """A block or lease the request names is not there (NOT_FOUND)."""


class FrameError(ValueError):
    """A KV frame (ember.kv.wire) this reader cannot use (INVALID_ARGUMENT), or damaged (its
    CorruptFrame subclass: DATA_LOSS). Here, not in the wire module, so a service that only maps
    errors to statuses (the router) never imports the codec and numpy."""
    status = "INVALID_ARGUMENT"
