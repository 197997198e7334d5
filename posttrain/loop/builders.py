"""Build the run's parts from the config: tokenizer + model, task, engine, learner.

Builders take the config sections and pass flat arguments into the parts, so config objects
never leak into the classes below the loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import torch

from posttrain.algos.kl import AdaptiveKLController
from posttrain.config import RunConfig
from posttrain.config.engines import engine_entry
from posttrain.dotted import import_dotted
from posttrain.learner.grad_sync import GradientSync
from posttrain.learner.protocol import Learner
from posttrain.learner.settings import (
    BatchingSettings,
    ComputeSettings,
    LoraSettings,
    OptimizerSettings,
    PolicyLossSettings,
    PolicySettings,
    SamplerReplay,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.envs.task import Task
    from posttrain.learner.actor import PolicyLearner
    from posttrain.learner.ranks import LearnerRanks
    from posttrain.rollout.engine import RolloutEngine

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def build_model(cfg: RunConfig) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, causal LM)`` for ``cfg.model.path`` (see ModelConfig.path)."""
    return load_model(cfg.model.path, cfg.model.dtype, init_seed=cfg.model.init_seed)


def load_model(path: str, dtype_name: str, *, init_seed: int) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, causal LM)`` of ``path`` in ``dtype_name``: ``builtin:NAME`` (a builtin tiny preset is
    initialised from ``init_seed``; SmolLM2 is converted on first use) or a Hugging Face model directory
    (a checkpoint's ``actor/``)."""
    dtype = _DTYPES[dtype_name]
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name.startswith("smollm2"):
            from posttrain.models.smollm2 import load_smollm2

            tok, model = load_smollm2(name)
            return tok, model.to(dtype).eval()
        from posttrain.models import build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer()
        model = build_tiny_model(name, vocab_size=len(tok), seed=init_seed, dtype=dtype)
        return tok, model
    from transformers import AutoModelForCausalLM

    from posttrain.models.tokenizer import load_pretrained_tokenizer

    tok = load_pretrained_tokenizer(path)  # a char model's checkpoint reloads its own tokenizer class
    hf: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf.eval()
    return tok, hf


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer of model ``path`` without loading its weights: a builtin char preset's, SmolLM2's
    once converted (None before: the conversion loads the model), or a model directory's
    (:func:`~posttrain.models.tokenizer.load_pretrained_tokenizer`)."""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name.startswith("smollm2"):
            from posttrain.models.smollm2 import converted_dir, is_converted

            folder = converted_dir(name)
            if not is_converted(folder):
                return None
            path = str(folder)
        else:
            from posttrain.models import build_char_tokenizer

            return build_char_tokenizer()
    from posttrain.models.tokenizer import load_pretrained_tokenizer

    return load_pretrained_tokenizer(path)


#: Text whose token ids (the student's encoding) must decode to the same text with both tokenizers
#: (letters, digits, punctuation, spaces: printable ASCII, which the builtin char tokenizer encodes).
TOKENIZER_PROBE = "Compute 12 + 7 * (3 - 1) = 26. Answer: <answer>26</answer> ok? [x_y] {a|b} ~$#@!"


def check_same_tokenizer(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase, *, student_path: str,
                         teacher_path: str) -> None:
    """Refuse a distillation teacher whose tokenizer differs from the student's: one
    :class:`~posttrain.errors.ConfigError` naming both paths and the first difference among the
    vocabulary size (``len``), the end-of-sequence id, the vocabulary (token -> id) and a round trip
    (the student's ids of :data:`TOKENIZER_PROBE` decoded by each). The teacher scores the student's
    token ids, so every id must mean the same token to both (how each splits raw text is not compared:
    the teacher never encodes)."""
    from posttrain.errors import ConfigError

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"loss.distill.teacher={teacher_path}: its tokenizer differs from the student's "
                           f"(model.path={student_path}): {what}; the teacher must share the student's tokenizer")

    for what, a, b in (("vocabulary size", len(student), len(teacher)),
                       ("eos token id", student.eos_token_id, teacher.eos_token_id)):
        if a != b:
            raise refuse(f"{what} {b} vs {a}")
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        tok = next((k for k in sorted(set(sv) | set(tv)) if sv.get(k) != tv.get(k)), "?")
        raise refuse(f"token {tok!r} has id {tv.get(tok)} vs {sv.get(tok)}")
    ids = list(student(TOKENIZER_PROBE, add_special_tokens=False).input_ids)
    a_text, b_text = student.decode(ids), teacher.decode(ids)
    if a_text != b_text:
        raise refuse(f"the student's ids of {TOKENIZER_PROBE!r} decode to {b_text!r} vs {a_text!r}")


def build_teacher(cfg: RunConfig, student_tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module | None:
    """The frozen distillation teacher of ``loss.distill`` (None without it): ``loss.distill.teacher`` (a run's
    checkpoint ``step_N`` stands for its ``actor/``) loaded like ``model.path`` (same dtype; a builtin tiny preset from ``model.init_seed``), in eval mode
    without gradients, after :func:`check_same_tokenizer` against ``student_tokenizer``."""
    d = cfg.loss.distill
    if d is None:
        return None
    from posttrain.config.paths import resolve_model_dir

    path = d.teacher if d.teacher.startswith("builtin:") else str(resolve_model_dir(d.teacher))
    tok, teacher = load_model(path, cfg.model.dtype, init_seed=cfg.model.init_seed)
    check_same_tokenizer(student_tokenizer, tok, student_path=cfg.model.path, teacher_path=d.teacher)
    return teacher.eval().requires_grad_(False)


def is_char_preset(model_path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> bool:
    """Whether the model is a posttrain char-tokenizer model: a builtin preset (every builtin but
    SmolLM2), or a saved one (a checkpoint's ``actor/``), recognised by the char tokenizer's chat template."""
    from posttrain.models.tokenizer import CHAT_TEMPLATE

    if model_path.startswith("builtin:"):
        return not model_path.split(":", 1)[1].startswith("smollm2")
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) == CHAT_TEMPLATE


def build_renderer(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> PromptRenderer:
    """The run's :class:`~posttrain.envs.prompt_render.PromptRenderer` (``task.chat_template``,
    ``task.system_prompt``); ``ValueError`` naming the key when ``true`` meets a template-less tokenizer."""
    from posttrain.envs.prompt_render import PromptRenderer, resolve_chat

    chat = resolve_chat(cfg.task.chat_template, tokenizer, char_preset=is_char_preset(cfg.model.path, tokenizer))
    return PromptRenderer(tokenizer, chat=chat, system_prompt=cfg.task.system_prompt)


# A single-turn task already built for this config (by the preflight, posttrain/loop/preflight.py):
# the run's build_task takes it instead of building (loading a dataset) a second time.
_KEPT_TASK: dict[str, Any] = {}


def _task_key(cfg: RunConfig) -> str:
    """What a single-turn task is built from: ``task.*``, ``reward.extract``, ``reward.functions``."""
    import json

    return json.dumps([cfg.task.model_dump(mode="json"), cfg.reward.extract,
                       [f.model_dump(mode="json") for f in cfg.reward.functions]], sort_keys=True, default=str)


def keep_task(cfg: RunConfig, task: Task) -> None:
    """Hand ``task`` (built by :func:`build_task` for ``cfg``) to the next :func:`build_task` of an equal
    task config, once; a newer kept task replaces an older one."""
    _KEPT_TASK.clear()
    _KEPT_TASK[_task_key(cfg)] = task


def build_task(cfg: RunConfig) -> Any:
    """The task named by ``cfg.task.name`` (registry name or ``module:factory``); with ``env.name``
    set, the environment's :class:`~posttrain.envs.episodes.EnvTask` (multi-turn episodes).

    A task kept by :func:`keep_task` for the same task config is returned (once) instead of a new one."""
    from posttrain.algos.hyperparameters import validated_factory_kwargs
    from posttrain.envs import TASKS

    if cfg.env.name is not None:
        from posttrain.envs.episodes import build_env_task

        return build_env_task(cfg.env.name, cfg.env.kwargs, cfg.env.heldout_fraction)
    kept = _KEPT_TASK.pop(_task_key(cfg), None)
    if kept is not None:
        return kept

    name = cfg.task.name
    factory = import_dotted(name, what="task.name") if ":" in name else TASKS[name]
    # typed against the factory's signature (a plug-in's too); the built-in factories check their fields
    kwargs = validated_factory_kwargs(factory, cfg.task.kwargs, key="task.kwargs", what=f"task {name!r}")
    try:
        task = factory(**kwargs)
    except TypeError as e:  # a wrong keyword for this task's factory is a config error
        raise ValueError(f"task.kwargs {cfg.task.kwargs} do not fit task {name!r}: {e}") from None
    if cfg.reward.extract != "none":  # reward.extract: the verifier judges the answer read from the response
        import dataclasses

        from posttrain.rewards.extract import with_extraction

        verifier = with_extraction(task.verifier, cfg.reward.extract)
        if dataclasses.is_dataclass(task) and not isinstance(task, type):
            task = dataclasses.replace(task, verifier=verifier)
        else:
            task = copy.copy(task)
            task.verifier = verifier
    if cfg.reward.functions:  # reward.functions: extra raw components next to the task verifier's
        from posttrain.rewards.plugins import with_reward_functions

        task = with_reward_functions(task, [(str(f.name), f.path) for f in cfg.reward.functions])
    return task


def build_engine(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: RunConfig | None = None,
                 workdir: Path | None = None) -> RolloutEngine:
    """The rollout engine of ``cfg.rollout.engine`` in this process (the local backend, every system mode).

    builtin in process (also with ``cfg=None``: evaluation and checks): a :class:`BuiltinEngine` over its own
    copy of the weights (synced after each update), with the tokenizer; any other engine of the registry
    (``rollout.process: server`` too): its :func:`engine_factory` called here, then :func:`probe_engine`.
    ``workdir``: the run directory (the vLLM engine's model export and server log go under it).
    """
    if cfg is None or (cfg.rollout.engine == "builtin" and cfg.rollout.process == "in_process"):
        from posttrain.rollout.builtin import BuiltinEngine

        # The tokenizer travels along in-process (stop strings); the Ray factory stays tokenizer-free.
        from posttrain.rollout.precision import engine_copy

        precision = "auto" if cfg is None else cfg.rollout.precision
        engine_model = engine_copy(model, precision)
        engine_model = copy.deepcopy(model) if engine_model is model else engine_model
        return BuiltinEngine(engine_model.eval(), tokenizer, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id or 0)
    if workdir is None:
        raise ValueError(f"rollout.engine={cfg.rollout.engine} needs a run directory for its engine files")
    engine = engine_factory(cfg, model, tokenizer, workdir)()
    probe_engine(engine, tokenizer, f"rollout.engine={cfg.rollout.engine}")
    return engine


def probe_engine(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, key: str) -> None:
    """One greedy 1-token request, so an engine that cannot serve this model with these settings (e.g.
    vLLM's CPU attention without a kernel for the model's head size) fails while the run is built, as
    one ``ValueError`` naming ``key``, instead of at the step-0 evaluation. The engine is closed first."""
    from posttrain.rollout.sampling import SamplingParams
    from posttrain.rollout.types import GenerationRequest

    ids = list(tokenizer("1").input_ids) or [int(tokenizer.eos_token_id or 0)]
    req = GenerationRequest(request_id="engine-probe", prompt_ids=ids,
                            params=SamplingParams(temperature=0.0, max_new_tokens=1, n=1, seed=0))
    try:
        engine.generate([req])
    except Exception as e:  # noqa: BLE001 - whatever the first request would raise is a settings error
        close = getattr(engine, "close", None)
        if close is not None:
            close()
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{key}: the engine cannot serve this model with these settings (a first 1-token "
                         f"request failed: {why})") from None


def engine_factory(cfg: RunConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, workdir: Path
                   ) -> Callable[[], RolloutEngine]:
    """A picklable zero-argument factory of the ``cfg.rollout.engine`` engine (the Ray rollout workers
    call it once per process, again after a restart; :func:`build_engine` calls it locally).

    The engine's registry entry (:data:`posttrain.config.engines.ENGINES`) names its factory function
    ``(cfg, model, tokenizer, workdir) -> Callable[[], RolloutEngine]`` by ``"module:attr"``; it is imported
    here (:func:`~posttrain.dotted.import_dotted`; ``ValueError`` naming the engine when the path does not
    resolve) and called: the built-in, vLLM and HTTP engines' are in :mod:`posttrain.loop.engine_factories`.
    """
    entry = engine_entry(cfg.rollout.engine)
    make = import_dotted(entry.factory, what=f"rollout engine {entry.name!r} factory")
    built: Callable[[], RolloutEngine] = make(cfg, model, tokenizer, workdir)
    return built


def _sampler_replay(cfg: RunConfig) -> SamplerReplay:
    """The sampler's distribution for the learner: its temperature, and its ``top_k`` / ``top_p`` when
    ``sampling.replay_truncation`` (and sampling is not greedy), else no truncation (the full softmax)."""
    s = cfg.sampling
    temperature = max(s.temperature, 1e-6) if s.temperature > 0 else 1.0
    if not s.replay_truncation or s.temperature == 0:
        return SamplerReplay(temperature=temperature)
    return SamplerReplay(temperature=temperature, top_k=s.top_k, top_p=s.top_p)


def build_kl_coef(cfg: RunConfig) -> float | AdaptiveKLController:
    """The run's KL coefficient beta: ``loss.kl_coef`` as a float, or with ``loss.kl_target`` an
    :class:`~posttrain.algos.kl.AdaptiveKLController` (Ziegler et al. 2019, arXiv:1909.08593; bounded
    update, ``loss.kl_horizon`` in samples) starting at ``loss.kl_coef``.

    One object serves both placements: the learner holds it (and checkpoints its state) whether the KL
    enters the loss or, with ``credit.kl_in_reward``, the token rewards (then the learner has no KL
    estimator and the loop reads ``learner.kl_coef`` for :func:`~posttrain.loop.targets.build_targets`);
    the loop updates it once per step from the KL it observed (``posttrain.loop.kl_control.observe_kl``)."""
    if cfg.loss.kl_target is None:
        return float(cfg.loss.kl_coef)
    return AdaptiveKLController(cfg.loss.kl_coef, cfg.loss.kl_target, cfg.loss.kl_horizon)


def policy_settings(cfg: RunConfig, *, autocast_dtype: str | None = None) -> PolicySettings:
    """The recipe's :class:`~posttrain.learner.settings.PolicySettings`: ``optim.*`` (the schedule spans
    ``steps x ppo_epochs x num_minibatches`` optimiser steps), ``loss.*`` (no KL estimator with
    ``credit.kl_in_reward``: the KL is in the reward), ``correction.*``, ``lora.*``, the sampler's
    temperature and truncation; ``autocast_dtype`` is the learner rank's mixed precision."""
    o = cfg.optim
    reduction_kwargs = {"max_len": cfg.sampling.max_new_tokens} if cfg.loss.reduction == "seq_mean_token_sum_norm" else {}
    return PolicySettings(
        optim=OptimizerSettings(
            lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps,
            total_steps=max(cfg.steps * o.ppo_epochs * o.num_minibatches, 1), lr_schedule=o.schedule,
            max_grad_norm=o.max_grad_norm,
        ),
        batching=BatchingSettings(epochs=o.ppo_epochs, num_minibatches=o.num_minibatches,
                                  microbatch_tokens=o.microbatch_tokens, seed=cfg.seed),
        loss=PolicyLossSettings(
            policy_loss=cfg.loss.policy_loss, policy_loss_kwargs=cfg.loss.kwargs, reduction=cfg.loss.reduction,
            reduction_kwargs=reduction_kwargs,
            kl_estimator=None if cfg.credit.kl_in_reward else cfg.loss.kl_estimator,
            entropy_coef=cfg.loss.entropy_coef, correction=cfg.correction.name,
            correction_kwargs=cfg.correction.kwargs, skip_no_signal_rows=o.skip_no_signal_rows,
            mask_truncated=cfg.loss.mask_truncated,
        ),
        sampler=_sampler_replay(cfg),
        compute=ComputeSettings(autocast_dtype=autocast_dtype, gradient_checkpointing=cfg.optim.gradient_checkpointing,
                                share_prompts=cfg.optim.share_prompts),
        lora=LoraSettings(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules,
                          dropout=cfg.lora.dropout),
    )


def build_learner(cfg: RunConfig, model: torch.nn.Module, *, grad_sync: GradientSync | None = None,
                  autocast_dtype: str | None = None) -> Learner:
    """The policy learner (the :class:`~posttrain.learner.protocol.Learner` the loop calls) with the recipe's settings (:func:`policy_settings`) and KL coefficient
    (:func:`build_kl_coef`: held in both KL placements and checkpointed; applied in the loss only without
    ``credit.kl_in_reward``).

    ``learner.strategy`` ddp / fsdp2 (or a CUDA learner): a :class:`~posttrain.learner.ranks.LearnerRanks`
    whose rank processes each build this same learner with their ``grad_sync`` hook
    (:class:`RankLearnerFactory`); ``model`` stays the driver's full CPU copy."""
    if grad_sync is None and cfg.learner.strategy != "single":
        return build_learner_ranks(cfg, model)
    if autocast_dtype is None and cfg.learner.precision == "bf16":  # bf16 compute, float32 master weights
        autocast_dtype = "bfloat16"
    return build_policy_learner(cfg, model, grad_sync=grad_sync, autocast_dtype=autocast_dtype)


def build_policy_learner(cfg: RunConfig, model: torch.nn.Module, *, grad_sync: GradientSync | None = None,
                         autocast_dtype: str | None = None) -> PolicyLearner:
    """The in-process :class:`~posttrain.learner.actor.PolicyLearner` of :func:`build_learner`, whatever
    ``learner.strategy`` says (for callers that need its gradients: ``posttrain check``, benchmarks)."""
    from posttrain.learner.actor import PolicyLearner

    s = policy_settings(cfg, autocast_dtype=autocast_dtype)
    return PolicyLearner(model, optim=s.optim, batching=s.batching, loss=s.loss, sampler=s.sampler,
                         compute=s.compute, lora=s.lora, kl_coef=build_kl_coef(cfg), grad_sync=grad_sync)


class RankLearnerFactory:
    """Picklable: a learner rank's ``PolicyLearner`` from the recipe (:func:`build_learner` with the rank's hook)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def __call__(self, model: torch.nn.Module, *, grad_sync: GradientSync,
                 autocast_dtype: str | None = None) -> PolicyLearner:
        return build_policy_learner(self.cfg, model, grad_sync=grad_sync, autocast_dtype=autocast_dtype)


class RankFaults(TypedDict, total=False):
    """Test-only :class:`~posttrain.learner.ranks.LearnerRanks` arguments :func:`build_learner_ranks` passes on."""

    grad_divide_factor: float
    drop_rank: int | None
    corrupt_bucket: int | None


def build_learner_ranks(cfg: RunConfig, model: torch.nn.Module, **faults: Unpack[RankFaults]) -> LearnerRanks:
    """``learner.world_size`` rank processes (``learner.strategy``) driven from here; see docs/distributed.md.

    ``model`` is the driver's copy; each rank starts from a pickled copy of it. ``faults`` go to
    :class:`~posttrain.learner.ranks.LearnerRanks` (tests inject ``grad_divide_factor``, ``drop_rank``,
    ``corrupt_bucket``)."""
    from posttrain.learner.ranks import LearnerRanks

    lc = cfg.learner
    replay = _sampler_replay(cfg)
    start_ranks = None  # spawned rank processes on this machine
    if cfg.system.backend == "ray":  # ranks as Ray actors placed by system.ray (docs/distributed.md)
        from posttrain.loop.backends import ray_rank_starter

        start_ranks = ray_rank_starter(cfg.system.ray, gpu=lc.resolved_device() == "cuda")
    return LearnerRanks(
        model, RankLearnerFactory(cfg), strategy=lc.strategy, world_size=lc.world_size,
        device=lc.resolved_device(), precision=lc.precision, temperature=replay.temperature,
        top_k=replay.top_k, top_p=replay.top_p, kl_coef=build_kl_coef(cfg), rank_timeout_s=lc.rank_timeout_s,
        startup_timeout_s=lc.startup_timeout_s, weight_bucket_bytes=max(1, int(lc.weight_bucket_mb * 2**20)),
        start_ranks=start_ranks, microbatch_tokens=cfg.optim.microbatch_tokens, **faults,
    )
