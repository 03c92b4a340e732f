"""The task ``dtorch rl`` trains on, shipped with the package (nothing to download): reverse the digits.

A prompt is ``<bos> d1 d2 ... dn =``; the right completion is ``dn ... d2 d1``. The reward of a completion
is the fraction of its positions that hold the right digit, so a policy that gets some positions right
earns partial credit (a random one about 1 / vocab per position: the reward starts above 0).
"""
from __future__ import annotations

import torch

DIGITS = 10
BOS, SEP = DIGITS, DIGITS + 1  # token ids 0..9 are the digits
VOCAB_SIZE = DIGITS + 2


class ReverseDigits:
    """Prompts of ``n_digits`` random digits; ``reward`` scores completions in plain Python/torch."""

    vocab_size = VOCAB_SIZE

    def __init__(self, n_digits: int = 4):
        if n_digits < 1:
            raise ValueError(f"n_digits must be at least 1, got {n_digits}")
        self.n_digits = n_digits

    @property
    def prompt_length(self) -> int:
        return self.n_digits + 2

    @property
    def completion_length(self) -> int:
        return self.n_digits

    def prompts(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``[n, n_digits + 2]`` token ids: ``<bos>``, the digits, ``=``."""
        digits = torch.randint(0, DIGITS, (n, self.n_digits), generator=generator)
        return torch.cat([torch.full((n, 1), BOS), digits, torch.full((n, 1), SEP)], dim=1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """``[n, n_digits]``: the digits of each prompt, reversed."""
        return prompts[:, 1:1 + self.n_digits].flip(1)

    def reward(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        """``[n]`` float: the fraction of completion positions holding the right digit."""
        return (completions[:, :self.n_digits] == self.answers(prompts)).float().mean(1)

    @staticmethod
    def render(ids) -> str:
        """Token ids as text: digits, ``=`` and ``^`` for ``<bos>``."""
        return "".join("^" if t == BOS else "=" if t == SEP else str(int(t)) for t in ids)
