"""The loop-side half of config validation: what a :class:`~posttrain.config.RunConfig` needs beyond
itself, checked before the run directory is written.

:mod:`posttrain.config` validates what the recipe says (types, bounds, combinations, dead
settings) and runs nothing. :func:`validate_run` checks the config against the rest of the house
and this machine:

- the algorithm names resolve in the registries of :mod:`posttrain.algos` (a ``module:function``
  plug-in is imported and registered now), the estimator's declared needs are met
  (:func:`posttrain.loop.targets.check_estimator_needs`) and the ``kwargs`` fit their functions
  (:func:`posttrain.loop.algo_kwargs.check_algo_kwargs`: each function's typed model, derived from its
  signature, then one dry call on tiny tensors; the config keeps the validated values);
- user modules import: ``reward.functions``, ``eval.hidden_verifier``, an ``env.name`` plug-in,
  whose declared reward parts must cover ``reward.weights``;
- this machine has what the recipe asks for: the ``model.path`` directory, the vLLM environment,
  native bf16 for ``rollout.precision=bf16``, the tracker packages, a visible GPU for ``learner.device=cuda`` / ``learner.precision=bf16``.

Every failure is one :class:`~posttrain.errors.ConfigError` line, worded and prefixed as the
config's own errors (``<source>: <key>: <why>``). :func:`load_run_config` is the loader of the
commands: parse, validate, warn. :func:`validate_recorded_config` reads a run's saved ``config.yaml`` for
the commands that only read a run (``posttrain eval``): none of a new run's refusals, and of this
machine's checks only what reading the run builds here (model, reward functions, hidden verifier,
environment), not the training machine's (GPU, vLLM environment, trackers) nor the algorithms.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import torch

import posttrain.algos as A
from posttrain.config import RunConfig, log_warnings, parse_config, parse_recorded_config, read_recipe
from posttrain.config.dead_settings import GivenKeys
from posttrain.config.engines import engine_entry
from posttrain.dotted import import_dotted
from posttrain.envs.episodes import ENVS, check_env_reward_weights, check_tool_prompt, check_tool_switch
from posttrain.errors import ConfigError
from posttrain.loop.algo_kwargs import check_algo_kwargs
from posttrain.loop.targets import check_estimator_needs
from posttrain.loop.trackers import TRACKING_EXTRA
from posttrain.rewards.hidden import build_hidden_verifier
from posttrain.rewards.plugins import check_reward_function

VLLM_ENV_HINT = "build it with `make vllm-env` (docs/rollout.md)"
# Experiment trackers beside metrics.jsonl: config key -> the module it imports. All three come
# with one extra (docs/diagnostics.md, "Tracking").
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def load_run_config(recipe: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """A recipe (path or shipped name; None = all defaults) with ``overrides``, parsed
    (:func:`posttrain.config.parse_config`), validated against the house and this machine
    (:func:`validate_run`), its warnings logged. Raises :class:`~posttrain.errors.ConfigError`."""
    data, source = read_recipe(recipe, overrides)
    cfg = parse_config(data, source, overrides or ())
    validate_run(cfg, source)
    log_warnings(cfg, source, GivenKeys.of(data, overrides or ()))
    return cfg


def validate_config(data: dict[str, object], source: str) -> RunConfig:
    """A nested mapping (e.g. a run's saved ``config.yaml``) parsed (:func:`posttrain.config.parse_config`)
    and validated against the house and this machine (:func:`validate_run`), same one-line errors."""
    cfg = parse_config(data, source)
    validate_run(cfg, source)
    return cfg


def validate_recorded_config(data: dict[str, object], source: str) -> RunConfig:
    """A run's saved ``config.yaml`` (``data``, as edited by the reading command) read as recorded
    (:func:`posttrain.config.parse_recorded_config`: a refusal of a new run is one warning line) and
    checked for what reading the run builds on this machine (:func:`validate_run` with ``recorded=True``)."""
    cfg = parse_recorded_config(data, source)
    validate_run(cfg, source, recorded=True)
    return cfg


def validate_run(cfg: RunConfig, source: str = "config", *, recorded: bool = False) -> None:
    """Raise :class:`~posttrain.errors.ConfigError` (``<source>: <key>: <why>``, one line) when ``cfg``
    names what does not exist or cannot run here; return None when every check passes.

    First the sections (every failing one reported, joined by ``; `` as the config's own field
    errors are), then the whole-run checks, first failure only. ``recorded``: ``cfg`` is a run's saved
    config read to evaluate it, so only what that builds is checked (model, reward functions, hidden
    verifier, the environment's name); the training machine's GPU, vLLM environment and trackers and the
    algorithms are not (they may be absent here, and the evaluation uses none of them).
    """
    errors = []
    for loc, check in _section_checks(cfg, recorded):
        try:
            check()
        except ValueError as e:
            errors.append(f"{source}: {loc}: {e}")
    if errors:
        raise ConfigError("; ".join(errors))
    try:
        if recorded:
            _check_env_name(cfg)
        else:
            _check_registries(cfg)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _section_checks(cfg: RunConfig, recorded: bool) -> list[tuple[str, Callable[[], None]]]:
    """``(key the error is reported under, check)`` in the order of the recipe's sections (``recorded``:
    those of what reading a saved run builds)."""
    checks: list[tuple[str, Callable[[], None]]] = [("model.path", lambda: _check_model_path(cfg.model.path))]
    for i, f in enumerate(cfg.reward.functions):
        checks.append((f"reward.functions.{i}", functools.partial(_check_reward_function, f.path)))
    if recorded:
        return [*checks, ("eval", lambda: _check_hidden_verifier(cfg))]
    checks += [("learner", lambda: _check_learner_device(cfg)), ("rollout", lambda: _check_engine_env(cfg)),
               ("eval", lambda: _check_hidden_verifier(cfg)), ("logging", lambda: _check_trackers(cfg))]
    if cfg.system.backend == "ray":  # bundles a local cluster can never hold: refused now, not after startup_timeout_s
        ranks = cfg.learner.world_size if cfg.learner.strategy != "single" else 0
        checks.append(("system.ray", lambda: cfg.system.ray.check_local_cpus(cfg.ray_reward_actors(), ranks)))
    return checks


def _check_reward_function(path: str) -> None:
    check_reward_function(path, f"reward.functions {path!r}")  # import + signature, now


def _check_model_path(path: str) -> None:
    # Nothing is fetched from the hub, so a local directory must exist now: otherwise the run
    # directory is created first and transformers fails later with a hub-lookup traceback.
    if path.startswith("builtin:"):
        return
    d = Path(path).expanduser()
    if not d.is_dir():
        if d.name == "actor" and d.parent.parent.name == "checkpoints":  # a later stage of a pipeline
            run = d.parent.parent.parent
            raise ValueError(f"{path!r} is not there yet: it is a checkpoint of the run {str(run)!r}, which has "
                             f"not reached {d.parent.name} (train that stage first, or set model.path)")
        raise ValueError(f"{path!r} is not a local model directory (no such directory; builtin models are "
                         "'builtin:<preset>')")
    if not (d / "config.json").is_file():
        if (d / "actor" / "config.json").is_file():  # a run's checkpoint step_N: the policy is its actor/
            raise ValueError(f"{path!r} is a posttrain checkpoint, not a model directory: use its policy, "
                             f"model.path={d / 'actor'}")
        raise ValueError(f"{path!r} has no config.json (not a Hugging Face model directory)")


def _check_learner_device(cfg: RunConfig) -> None:
    lc = cfg.learner
    if lc.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("learner.device=cuda but no CUDA GPU is visible (torch.cuda.is_available() is False)")
        if lc.strategy == "single":
            raise ValueError("learner.device=cuda runs the learner in rank processes: set learner.strategy=ddp "
                             "or fsdp2 (world_size 1 is allowed)")
        if lc.world_size > torch.cuda.device_count():
            raise ValueError(f"learner.world_size={lc.world_size} > {torch.cuda.device_count()} visible GPUs")
    if lc.precision == "bf16" and lc.resolved_device() != "cuda":
        check_learner_cpu_bf16(lc.strategy)


def check_learner_cpu_bf16(strategy: str, flags: frozenset[str] | None = None) -> str:
    """``learner.precision=bf16`` on CPU: bf16 autocast over float32 master weights (Micikevicius et al. 2018,
    arXiv:1710.03740, with bfloat16 instead of float16: no loss scaling), for ``strategy`` single or ddp.
    Returns the native feature it runs on; ``ValueError`` (one line) for fsdp2 on CPU, or a CPU without native
    bf16 products (AVX512_BF16 / AMX-BF16, :func:`posttrain.rollout.precision.native_bf16`), where bf16 runs
    slower than fp32. ``flags``: the CPU's flags (default: this machine's)."""
    from posttrain.rollout.precision import cpu_flags, native_bf16

    if strategy == "fsdp2":
        raise ValueError("learner.precision=bf16 with learner.strategy=fsdp2 needs learner.device=cuda (its "
                         "MixedPrecisionPolicy is not run on CPU): use learner.strategy=single or ddp on CPU")
    feature = native_bf16(cpu_flags() if flags is None else flags)
    if feature is None:
        raise ValueError("learner.precision=bf16 needs a CPU with native bf16 products (AVX512_BF16 or AMX-BF16) "
                         "or learner.device=cuda; this CPU has neither: use learner.precision=fp32")
    return feature


def _check_engine_env(cfg: RunConfig) -> None:
    """This machine can run ``rollout.engine``: a bf16 ``rollout.precision`` of an engine it applies to on this
    CPU, and the engine's own ``machine_check`` (:data:`posttrain.config.engines.ENGINES`), one-line ``ValueError``."""
    ro = cfg.rollout
    entry = engine_entry(ro.engine)
    if entry.has_precision_axis and ro.precision == "bf16":
        from posttrain.rollout.precision import check_engine_precision

        check_engine_precision(ro.precision, "cpu")  # the builtin engine samples on the driver's CPU
    if entry.machine_check is not None:
        import_dotted(entry.machine_check, what=f"rollout engine {entry.name!r} machine check")(cfg)


def check_vllm_env(cfg: RunConfig) -> None:
    """``rollout.engine: vllm``'s machine check: ``rollout.vllm.python`` is an executable interpreter, or with
    ``null`` vllm imports here; ``ValueError`` (one line naming the key and :data:`VLLM_ENV_HINT`) otherwise."""
    ro = cfg.rollout
    p = ro.vllm.python_path()
    if p is not None and not (p.is_file() and os.access(p, os.X_OK)):
        raise ValueError(f"rollout.vllm.python: no vLLM environment at {ro.vllm.python!r}; {VLLM_ENV_HINT}")
    if p is None and importlib.util.find_spec("vllm") is None:
        raise ValueError("rollout.vllm.python=null needs vllm importable in this environment; set "
                         f"rollout.vllm.python to a vLLM environment's interpreter ({VLLM_ENV_HINT})")


def _check_hidden_verifier(cfg: RunConfig) -> None:
    if cfg.eval.hidden_verifier is not None:
        build_hidden_verifier(cfg.eval.hidden_verifier, cfg.eval.hidden_verifier_kwargs)  # one line now, not mid-run


def _check_trackers(cfg: RunConfig) -> None:
    # A missing package is refused here, before the run directory is written.
    for key, module in TRACKER_MODULES.items():
        if getattr(cfg.logging, key) and importlib.util.find_spec(module) is None:
            raise ValueError(f"logging.{key}=true needs the {module} package: {TRACKING_EXTRA}")


def _check_registries(cfg: RunConfig) -> None:
    """Algorithm names, the estimator's needs, the environment and the algorithm kwargs (``ValueError``)."""
    for key, reg, name in (
        ("credit.estimator", A.ADVANTAGES, cfg.credit.estimator),
        ("loss.policy_loss", A.POLICY_LOSSES, cfg.loss.policy_loss),
        ("loss.reduction", A.REDUCTIONS, cfg.loss.reduction),
        ("loss.kl_estimator", A.KL_ESTIMATORS, cfg.loss.kl_estimator),
        ("correction.name", A.CORRECTIONS, cfg.correction.name),
    ):
        if name is not None:
            reg.resolve(name, key=key)  # a registered name, or 'module:function' imported and registered now
    check_estimator_needs(cfg)  # what the estimator declared it needs (critic, groups, baseline, step ids)
    _check_env_name(cfg)
    if cfg.env.name is not None:
        learned = cfg.reward.learned_components()  # added by the episode player (loop/episode_rollout.py)
        check_env_reward_weights(cfg.env.name, cfg.env.kwargs,
                                 {k: w for k, w in cfg.reward.weights.items() if k not in learned})  # like single-turn components
        if cfg.env.eval_without_tools:
            check_tool_switch(cfg.env.name, cfg.env.kwargs)  # else the step-0 evaluation fails
        if cfg.env.tool_prompt != "auto":  # set: it renders the environment's tools
            check_tool_prompt(cfg.env.name, cfg.env.kwargs, cfg.env.tool_prompt)
    check_algo_kwargs(cfg)


def _check_env_name(cfg: RunConfig) -> None:
    if cfg.env.name is not None and ":" not in cfg.env.name and cfg.env.name not in ENVS:
        raise ValueError(f"env.name: unknown env {cfg.env.name!r}; valid: {', '.join(sorted(ENVS))}, "
                         "or 'package.module:factory'")
