"""The learner: log-prob recompute, token-budget micro-batching, actor and critic updates,
atomic checkpoints. Imports trajectory, models and algos; nothing above it."""

from posttrain.learner.actor import PolicyLearner
from posttrain.learner.logprobs import forward_logprobs, token_logprobs
from posttrain.learner.microbatch import minibatch_rows, split_by_token_budget, take_rows
from posttrain.learner.schedule import build_optimizer, build_scheduler, lr_multiplier

__all__ = [
    "PolicyLearner",
    "build_optimizer",
    "build_scheduler",
    "forward_logprobs",
    "lr_multiplier",
    "minibatch_rows",
    "split_by_token_budget",
    "take_rows",
    "token_logprobs",
]
