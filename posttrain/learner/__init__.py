"""The learner: log-prob recompute, token-budget micro-batching, one trainer skeleton under the actor,
critic and SFT updates, typed settings, atomic checkpoints. Imports trajectory, models and algos;
nothing above it."""

from posttrain.learner.actor import PolicyLearner
from posttrain.learner.checkpoint import (
    CheckpointState,
    capture_rng,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    load_pretrained_weights,
    prune_checkpoints,
    restore_actor,
    restore_rng,
    save_checkpoint,
)
from posttrain.learner.critic import CriticLearner, ValueModel
from posttrain.learner.logprobs import forward_logprobs, token_logprobs
from posttrain.learner.microbatch import minibatch_rows, split_by_token_budget, take_rows
from posttrain.learner.schedule import build_optimizer, build_scheduler, lr_multiplier
from posttrain.learner.settings import (
    BatchingSettings,
    ComputeSettings,
    LoraSettings,
    OptimizerSettings,
    PolicyLossSettings,
    PolicySettings,
    SamplerReplay,
)
from posttrain.learner.sft import run_sft
from posttrain.learner.trainer import MinibatchLoss, Trainer

__all__ = [
    "BatchingSettings",
    "CheckpointState",
    "ComputeSettings",
    "CriticLearner",
    "LoraSettings",
    "MinibatchLoss",
    "OptimizerSettings",
    "PolicyLearner",
    "PolicyLossSettings",
    "PolicySettings",
    "SamplerReplay",
    "Trainer",
    "ValueModel",
    "build_optimizer",
    "build_scheduler",
    "capture_rng",
    "checkpoint_path",
    "forward_logprobs",
    "latest_checkpoint",
    "load_checkpoint",
    "load_pretrained_weights",
    "lr_multiplier",
    "minibatch_rows",
    "prune_checkpoints",
    "restore_actor",
    "restore_rng",
    "run_sft",
    "save_checkpoint",
    "split_by_token_budget",
    "take_rows",
    "token_logprobs",
]
