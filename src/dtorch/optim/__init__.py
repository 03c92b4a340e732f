"""dtorch.optim: torch's optimizers for dtorch parameters (states laid out like their parameters)."""
from .adamw import AdamW
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "AdamW"]
