"""dtorch.optim: torch's optimizers for dtorch parameters (states laid out like their parameters). They are
``torch.optim.Optimizer`` subclasses, so ``torch.optim.lr_scheduler``'s schedulers drive them."""
from .adam import Adam, AdamW
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
