"""Build the run's parts from the config: tokenizer + model, task, engine, learner.

Builders take the config sections and pass flat arguments into the parts, so config objects
never leak into the classes below the loop.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch

from posttrain.config import RunConfig

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load_callable(spec: str) -> Any:
    """Import ``'package.module:attr'`` (a user's plug-in function or class)."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"plug-in {spec!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"plug-in {spec!r} cannot be loaded: {e}") from None


def build_model(cfg: RunConfig) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, causal LM)`` for ``cfg.model.path`` (see ModelConfig.path)."""
    path, dtype = cfg.model.path, _DTYPES[cfg.model.dtype]
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name.startswith("smollm2"):
            from posttrain.models.smollm2 import load_smollm2

            tok, model = load_smollm2(name)
            return tok, model.to(dtype).eval()
        from posttrain.models import build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer()
        model = build_tiny_model(name, vocab_size=len(tok), seed=cfg.model.init_seed, dtype=dtype)
        return tok, model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return tok, model.eval()


def build_task(cfg: RunConfig) -> Any:
    """The task named by ``cfg.task.name`` (registry name or ``module:factory``)."""
    from posttrain.envs import TASKS

    name = cfg.task.name
    factory = load_callable(name) if ":" in name else TASKS[name]
    try:
        return factory(**cfg.task.kwargs)
    except TypeError as e:  # a wrong keyword for this task's factory is a config error
        raise ValueError(f"task.kwargs {cfg.task.kwargs} do not fit task {name!r}: {e}") from None


def build_engine(model: torch.nn.Module, tokenizer: Any) -> Any:
    """A built-in rollout engine over its own copy of the weights (synced after each update)."""
    from posttrain.rollout.builtin import BuiltinEngine

    return BuiltinEngine(copy.deepcopy(model).eval(), tokenizer, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id or 0)


def build_learner(cfg: RunConfig, model: torch.nn.Module) -> Any:
    """The policy learner with the recipe's loss, reduction, KL and correction."""
    from posttrain.algos.kl import AdaptiveKLController
    from posttrain.learner import PolicyLearner

    kl_coef: Any = cfg.loss.kl_coef
    if cfg.loss.kl_target is not None:
        kl_coef = AdaptiveKLController(cfg.loss.kl_coef, cfg.loss.kl_target, cfg.loss.kl_horizon)
    reduction_kwargs = {"max_len": cfg.sampling.max_new_tokens} if cfg.loss.reduction == "seq_mean_token_sum_norm" else {}
    return PolicyLearner(
        model,
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        weight_decay=cfg.optim.weight_decay,
        warmup_steps=cfg.optim.warmup_steps,
        total_steps=max(cfg.steps * cfg.optim.ppo_epochs * cfg.optim.num_minibatches, 1),
        lr_schedule=cfg.optim.schedule,
        max_grad_norm=cfg.optim.max_grad_norm,
        microbatch_tokens=cfg.optim.microbatch_tokens,
        ppo_epochs=cfg.optim.ppo_epochs,
        num_minibatches=cfg.optim.num_minibatches,
        policy_loss=cfg.loss.policy_loss,
        policy_loss_kwargs=cfg.loss.kwargs,
        reduction=cfg.loss.reduction,
        reduction_kwargs=reduction_kwargs,
        kl_estimator=None if cfg.credit.kl_in_reward else cfg.loss.kl_estimator,
        kl_coef=0.0 if cfg.credit.kl_in_reward else kl_coef,
        entropy_coef=cfg.loss.entropy_coef,
        temperature=max(cfg.sampling.temperature, 1e-6) if cfg.sampling.temperature > 0 else 1.0,
        correction=cfg.correction.name,
        correction_kwargs=cfg.correction.kwargs,
        seed=cfg.seed,
    )
