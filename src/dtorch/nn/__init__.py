"""dtorch.nn: modules whose parameters are dtorch tensors."""
from . import functional  # noqa: F401
