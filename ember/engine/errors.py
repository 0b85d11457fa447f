"""Engine errors: Ember's own types (ember.errors), by the engine's name for them."""
from ember.errors import CapacityError, IntegrityError, InvalidRequestError

__all__ = ["CapacityError", "IntegrityError", "InvalidRequestError"]
