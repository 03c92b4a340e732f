"""Operators, one module per op family. Importing this package registers them all."""
from . import registry  # noqa: F401
from . import factory, pointwise, view, reduce, matrix, nn, attention  # noqa: F401
