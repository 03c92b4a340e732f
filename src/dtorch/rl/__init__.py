"""dtorch.rl: RL post-training on one controller. The pieces of a GRPO step as library functions
(``token_logprobs``, ``group_advantages``, ``grpo_loss``), the weight sync is
``dtorch.nn.utils.copy_parameters_``, and ``dtorch rl`` runs the whole loop on a small Llama (docs/rl.md)."""
from .grpo import grpo_loss, group_advantages, token_logprobs

__all__ = ["token_logprobs", "group_advantages", "grpo_loss"]
