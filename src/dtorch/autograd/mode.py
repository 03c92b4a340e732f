"""Whether ops record autograd history: torch's own grad mode (``torch.no_grad()`` and ``dtorch.no_grad()``
are one switch, per thread), so code ported from PyTorch keeps its ``with torch.no_grad():`` blocks."""
from __future__ import annotations

import torch

is_grad_enabled = torch.is_grad_enabled
no_grad = torch.no_grad
enable_grad = torch.enable_grad
set_grad_enabled = torch.set_grad_enabled
