"""``RunConfig``: a full recipe — the six axes (feedback, sampling, credit, correction, reduction,
system) plus model, optimiser, learner, rollout engine, evaluation and run controls.

Its validator refuses combinations of keys that cannot run and keys that cannot take effect
(:mod:`posttrain.config.dead_settings`), from the config alone (:func:`check_new_run`). A run's saved
``config.yaml`` is read without them (validation context :data:`RECORDED`,
:func:`posttrain.config.loading.parse_recorded_config`): they protect a run about to start, and a run
recorded before a refusal existed stays readable by the commands that only read it.
"""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator, model_validator

from posttrain.config.algorithm import (
    CorrectionConfig,
    CreditConfig,
    LossConfig,
    OptimConfig,
    SamplingConfig,
    SFTConfig,
)
from posttrain.config.dead_settings import GivenKeys, check_dead_settings
from posttrain.config.engines import engine_entry
from posttrain.config.feedback import EnvConfig, RewardConfig, TaskConfig
from posttrain.config.learner import LearnerConfig
from posttrain.config.model import CriticConfig, LoraConfig, ModelConfig
from posttrain.config.monitoring import EvalConfig, GuardsConfig, LoggingConfig
from posttrain.config.preference import PreferenceConfig
from posttrain.config.rollout import RolloutConfig
from posttrain.config.section import Section
from posttrain.config.system import SystemConfig
from posttrain.config.trainers import trainer_entry, trainers_description


class RunConfig(Section):
    """A full recipe: the six axes plus model, optimiser and run controls."""

    name: str = "run"
    trainer: str = Field(default="rl", description=trainers_description())
    seed: int = 0
    steps: int = Field(default=50, ge=0)
    run_dir: str | None = Field(default=None, description="default: runs/<name>")
    resume: bool = Field(default=False, description="continue the run in run_dir from its latest complete checkpoint "
                         "(an error if there is none; a corrupt latest one falls back to the previous)")
    resume_force: bool = Field(default=False, description="resume even though the recipe differs from the run's "
                               "config.yaml (the old one is kept as config.step_<N>.yaml); without it such a "
                               "resume is refused with the differing keys")
    checkpoint_every: int = Field(default=10, ge=0, description="checkpoint every N steps (and at the end); a crash loses "
                                  "at most the steps since the last one. 0 = only at the end")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    env: EnvConfig = Field(default_factory=EnvConfig, description="multi-turn environment episodes (env.name set)")
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    credit: CreditConfig = Field(default_factory=CreditConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters on the policy (rank 0 = off)")
    critic: CriticConfig = Field(default_factory=CriticConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="where the policy update runs: "
                                   "embedded, or ddp / fsdp2 rank processes (docs/distributed.md)")
    system: SystemConfig = Field(default_factory=SystemConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the rollout engine (docs/rollout.md)")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig, description="preference pairs and loss "
                                         "(trainer=preference, trainer=reward_model)")
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("trainer")
    @classmethod
    def _known_trainer(cls, name: str) -> str:
        trainer_entry(name)  # one line listing the known names (posttrain.config.trainers.TRAINERS)
        return name

    @model_validator(mode="after")
    def _check_combinations(self, info: ValidationInfo) -> RunConfig:
        context = info.context or {}
        if not context.get("recorded"):  # a saved config.yaml is read as recorded
            check_new_run(self, context.get("given"))
        return self

    def ray_reward_actors(self) -> int:
        """Ray reward actors the run starts: ``system.ray.num_reward_workers`` with ``system.backend=ray`` for
        single-turn samples; 0 with another backend, or with ``env.name`` (episodes score themselves and their
        learned rewards are scored in the driver: nothing would call an actor)."""
        if self.system.backend != "ray" or self.env.name is not None:
            return 0
        return self.system.ray.num_reward_workers

    def axes(self) -> dict[str, str]:
        """The recipe's full composition along the six axes (for ``--print-recipe``)."""
        corr = self.correction.name or "none"
        return {
            "feedback": (f"env {self.env.name} {self.env.kwargs or ''} (multi-turn, max_turns {self.env.max_turns})"
                         if self.env.name is not None else f"task {self.task.name} {self.task.kwargs or ''}")
            + f" weights {self.reward.weights}"
            + (f" + overlong(L_max={self.reward.overlong_max_len}, L_cache={self.reward.overlong_cache_len})"
               if self.reward.overlong_max_len else ""),
            "sampling": f"G={self.sampling.group_size} x {self.sampling.prompts_per_step} prompts, "
            f"T={self.sampling.temperature}, top_p={self.sampling.top_p}, max_new={self.sampling.max_new_tokens}"
            + (", dynamic sampling" if self.sampling.dynamic_sampling else ""),
            "credit": f"{self.credit.estimator} {self.credit.kwargs or ''}"
            + (" + critic" if self.critic.enabled else "")
            + (f", KL in reward ({self.loss.kl_estimator}, coef {self.loss.kl_coef})" if self.credit.kl_in_reward else "")
            + (f"; distill from {self.loss.distill.teacher} (reverse KL per token, coef {self.loss.distill.coef}"
               + (", alone)" if self.loss.distill.only else ", added)") if self.loss.distill is not None else ""),
            "correction": f"{corr} {self.correction.kwargs or ''}",
            "reduction": f"{self.loss.reduction}; loss {self.loss.policy_loss} {self.loss.kwargs or ''}"
            + (f"; KL in loss {self.loss.kl_estimator} coef {self.loss.kl_coef}"
               if self.loss.kl_estimator and not self.credit.kl_in_reward else ""),
            "system": f"{self.system.mode} / {self.system.backend}"
            + (f", max_staleness {self.system.max_staleness}" if self.system.max_staleness is not None else "")
            + (f", max_queue {self.system.max_queue}" if self.system.max_queue is not None else "")
            + (f", partial rollout lambda={self.system.partial_fraction}" if self.system.partial_fraction < 1 else "")
            + (f", max_version_span {self.system.max_version_span}" if self.system.max_version_span is not None else ""),
        }


RECORDED = {"recorded": True}
"""Validation context of a run's saved ``config.yaml``: ``RunConfig.model_validate(data, context=RECORDED)``
checks types, bounds and unknown keys, not :func:`check_new_run`."""


def check_new_run(cfg: RunConfig, given: GivenKeys | None = None) -> None:
    """Raise ``ValueError`` (one line) when ``cfg`` combines keys that cannot run, or sets a key that cannot
    take effect (:func:`~posttrain.config.dead_settings.check_dead_settings`; ``given``: the keys the user
    wrote and typed, from the validation context ``{"given": GivenKeys}``), read from the config alone;
    return None otherwise. What needs the registries, user modules, a dry run of an algorithm or this
    machine is :func:`posttrain.loop.validate.validate_run`'s."""
    if cfg.env.name is not None and cfg.sampling.dynamic_sampling:
        raise ValueError(f"env.name={cfg.env.name}: multi-turn episodes need sampling.dynamic_sampling=false")
    if cfg.sampling.dynamic_sampling and (cfg.system.mode != "sync" or cfg.system.partial_fraction < 1.0):
        raise ValueError("sampling.dynamic_sampling is supported with system.mode=sync and partial_fraction=1 only")
    if cfg.system.max_queue is not None and cfg.system.max_queue < cfg.sampling.group_size:
        raise ValueError(f"system.max_queue={cfg.system.max_queue} cannot hold one group of "
                         f"sampling.group_size={cfg.sampling.group_size} samples")
    engine_entry(cfg.rollout.engine).check_run(cfg)  # the engine's own checks (posttrain.config.engines)
    if cfg.loss.kl_coef > 0 and cfg.loss.kl_estimator is None:
        raise ValueError("loss.kl_coef > 0 needs loss.kl_estimator (k1, k2 or k3)")
    if cfg.learner.strategy != "single" and cfg.lora.rank > 0:
        raise ValueError(f"learner.strategy={cfg.learner.strategy} does not support LoRA (lora.rank > 0); "
                         "use learner.strategy=single")
    if cfg.lora.rank > 0 and cfg.lora.dropout > 0 and cfg.optim.gradient_checkpointing:
        # posttrain/learner/actor.py: checkpointing acts in train mode only, where dropout is active
        raise ValueError(f"lora.dropout={cfg.lora.dropout} with optim.gradient_checkpointing=true: checkpointing "
                         "runs the gradient forward in train mode, where the adapters' dropout is active (pi_theta "
                         "would differ from pi_old); set lora.dropout=0 or optim.gradient_checkpointing=false")
    if cfg.optim.share_prompts and cfg.optim.gradient_checkpointing:
        # posttrain/learner/shared_prompt.py: the prompt forward's KV cache, which checkpointing turns off
        raise ValueError("optim.share_prompts=true with optim.gradient_checkpointing=true: the shared prompt is "
                         "reused through the model's KV cache, which a checkpointed gradient forward turns off; "
                         "set one of them")
    if cfg.optim.share_prompts and cfg.learner.strategy == "fsdp2":
        raise ValueError("optim.share_prompts=true with learner.strategy=fsdp2: the shared-prompt forward runs the "
                         "LM head on gathered hidden states, which a sharded head does not allow; use "
                         "learner.strategy=single or ddp")
    if cfg.learner.precision == "bf16" and cfg.model.dtype != "float32":
        raise ValueError(f"learner.precision=bf16 keeps float32 master weights: needs model.dtype=float32, "
                         f"got {cfg.model.dtype}")
    if cfg.correction.name is None and cfg.correction.kwargs:
        raise ValueError(f"correction.kwargs {cfg.correction.kwargs} given but correction.name is not set")
    entry = trainer_entry(cfg.trainer)
    entry.check_config(cfg)  # the trainer's own checks of the config alone (posttrain.config.trainers)
    check_dead_settings(cfg, given)  # a set key that cannot take effect is refused (warnings: load_config)
    if entry.samples(cfg) and cfg.sampling.temperature == 0 and cfg.sampling.group_size > 1:
        # Greedy decoding is a point mass: a group is one response repeated, so its group-relative
        # advantages are all 0 (the run trains nothing) and an online preference group holds no pair.
        raise ValueError(f"sampling.temperature=0 with sampling.group_size={cfg.sampling.group_size}: greedy "
                         "decoding repeats one response per prompt, so a group's samples never differ (zero "
                         "group-relative advantages, no preference pairs); set sampling.temperature > 0 "
                         "(or sampling.group_size=1)")
