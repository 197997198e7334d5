"""Typed run configuration: the single source of truth for keys, defaults and validation.

The ground floor above :mod:`posttrain.errors`: every config model (:class:`RunConfig` and its
sections, the rollout engine's :class:`RolloutConfig`, the Ray backend's :class:`RayBackendConfig`)
and the recipe loader, with no runtime work: nothing here imports a package of posttrain above it,
a user module or torch. What needs the registries, user modules, an algorithm dry run or this
machine (paths, installed packages, GPUs) is checked by :func:`posttrain.loop.validate.validate_run`
(docs/architecture.md, "Config").

A recipe is a YAML file validated into :class:`RunConfig`; ``key=value`` overrides on the
command line address nested keys with dots (``optim.lr=3e-4``).
"""

from __future__ import annotations

from posttrain.config.algorithm import (
    CorrectionConfig,
    CreditConfig,
    LossConfig,
    OptimConfig,
    SamplingConfig,
    SFTConfig,
)
from posttrain.config.feedback import EnvConfig, RewardConfig, RewardFunctionConfig, TaskConfig
from posttrain.config.learner import LearnerConfig
from posttrain.config.loading import (
    RECIPES_DIR,
    apply_overrides,
    dump_config,
    load_config,
    log_warnings,
    parse_config,
    parse_recorded_config,
    read_recipe,
    resolve_recipe_path,
)
from posttrain.config.model import CriticConfig, LoraConfig, ModelConfig
from posttrain.config.monitoring import EvalConfig, GuardsConfig, LoggingConfig
from posttrain.config.ray import RayBackendConfig
from posttrain.config.rollout import HTTPSettings, RolloutConfig, VLLMSettings
from posttrain.config.run import RunConfig
from posttrain.config.system import SystemConfig
from posttrain.errors import ConfigError

__all__ = [
    "RECIPES_DIR", "ConfigError", "CorrectionConfig", "CreditConfig", "CriticConfig", "EnvConfig", "EvalConfig",
    "GuardsConfig", "HTTPSettings", "LearnerConfig", "LoggingConfig", "LoraConfig", "LossConfig", "ModelConfig",
    "OptimConfig", "RayBackendConfig", "RewardConfig", "RewardFunctionConfig", "RolloutConfig", "RunConfig",
    "SFTConfig", "SamplingConfig", "SystemConfig", "TaskConfig", "VLLMSettings", "apply_overrides", "dump_config",
    "load_config", "log_warnings", "parse_config", "parse_recorded_config", "read_recipe",
    "resolve_recipe_path",
]
