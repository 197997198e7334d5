"""Dead settings: a key the user set that cannot take effect in the resolved config is refused at load.

One rule, applied everywhere (issue 22): a key counts as *set* when the recipe or an override gave
it (pydantic's ``model_fields_set``, recursively through the sections) **and** its value differs
from the field's default, **or** it was typed as a ``key=value`` override on the command line with a value
that does not switch it off (issue 38: ``posttrain train dpo task.name=arithmetic`` names the default task,
and offline DPO never reads it; ``reward.overlong_max_len=null`` says what happens anyway: :func:`unsets`).
Defaults written in a recipe file never trigger, so a saved ``config.yaml`` (which lists every key)
loads like the recipe that wrote it. A key no recipe or override wrote (a validator derived it, like
``system.max_staleness=1`` from ``system.mode=async``) is named only when no written key is refused. Each such key that the resolved config leaves without effect
is refused at load with one line naming the key and why (``severity="error"``), or, where refusing
would break a shipped recipe or a common override pattern (``posttrain train demo sft.steps=0``),
a one-line warning at load (``severity="warn"``). The choice per key lives in :data:`RULES`, the
only table of it; docs/architecture.md ("Config") describes the rule.

Each rule was checked against the code that consumes its key (noted next to it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from pydantic import BaseModel

from posttrain.config.engines import ENGINES
from posttrain.config.trainers import trainer_entry

if TYPE_CHECKING:
    from posttrain.config.algorithm import (
        CorrectionConfig,
        CreditConfig,
        LossConfig,
        OptimConfig,
        SamplingConfig,
        SFTConfig,
    )
    from posttrain.config.feedback import EnvConfig, RewardConfig, TaskConfig
    from posttrain.config.learner import LearnerConfig
    from posttrain.config.model import CriticConfig, LoraConfig, ModelConfig
    from posttrain.config.monitoring import EvalConfig, GuardsConfig, LoggingConfig
    from posttrain.config.preference import PreferenceConfig
    from posttrain.config.rollout import RolloutConfig
    from posttrain.config.system import SystemConfig


class RunConfigView(Protocol):
    """What the rules read of a run's config: met by :class:`posttrain.config.run.RunConfig` (a pydantic
    model). A structural type, so this module, which ``RunConfig``'s validator calls, does not import it."""

    @property
    def trainer(self) -> str: ...

    @property
    def resume(self) -> bool: ...

    @property
    def model(self) -> ModelConfig: ...

    @property
    def task(self) -> TaskConfig: ...

    @property
    def env(self) -> EnvConfig: ...

    @property
    def reward(self) -> RewardConfig: ...

    @property
    def sampling(self) -> SamplingConfig: ...

    @property
    def credit(self) -> CreditConfig: ...

    @property
    def correction(self) -> CorrectionConfig: ...

    @property
    def loss(self) -> LossConfig: ...

    @property
    def optim(self) -> OptimConfig: ...

    @property
    def lora(self) -> LoraConfig: ...

    @property
    def critic(self) -> CriticConfig: ...

    @property
    def learner(self) -> LearnerConfig: ...

    @property
    def system(self) -> SystemConfig: ...

    @property
    def rollout(self) -> RolloutConfig: ...

    @property
    def eval(self) -> EvalConfig: ...

    @property
    def sft(self) -> SFTConfig: ...

    @property
    def preference(self) -> PreferenceConfig: ...

    @property
    def guards(self) -> GuardsConfig: ...

    @property
    def logging(self) -> LoggingConfig: ...


@dataclasses.dataclass(frozen=True)
class Rule:
    """``keys`` (dotted; a section name covers every key under it) cannot take effect when
    ``dead(cfg)`` is true, because ``why``; ``severity`` says whether that is refused or warned."""

    keys: tuple[str, ...]
    dead: Callable[[RunConfigView], bool]
    why: str
    severity: Literal["error", "warn"] = "error"


def _samples(c: RunConfigView) -> bool:
    """Whether ``c``'s trainer samples responses from the task (:attr:`~posttrain.config.trainers.TrainerEntry.samples`)."""
    return trainer_entry(c.trainer).samples(c)


def _engine_is_not(name: str) -> Callable[[RunConfigView], bool]:
    """The predicate ``rollout.engine != name`` (the section of engine ``name`` is dead under any other)."""
    return lambda c: c.rollout.engine != name


def _not_builtin_tiny(c: RunConfigView) -> bool:
    p = c.model.path
    return not p.startswith("builtin:") or p.split(":", 1)[1].startswith("smollm2")


RULES: tuple[Rule, ...] = (
    # posttrain/loop/run.py open_run / preference_training.py: resume_force is read by check_resumable, which
    # runs for resume=true only (a fresh run never compares the recipe with a config.yaml).
    Rule(("resume_force",), lambda c: not c.resume,
         "resume is not true: resume_force only lets a resume=true go on with a recipe that differs from the "
         "run's config.yaml (set resume=true, or drop resume_force)"),
    # posttrain/loop/builders.py build_kl_coef: the adaptive controller scales loss.kl_coef; with no
    # estimator there is no KL to measure, with coef 0 it multiplies 0.
    Rule(("loss.kl_target", "loss.kl_horizon"), lambda c: c.loss.kl_estimator is None,
         "there is no KL term: loss.kl_estimator is not set"),
    Rule(("loss.kl_target", "loss.kl_horizon"), lambda c: c.loss.kl_coef == 0,
         "the adaptive controller scales loss.kl_coef, which is 0 (a 0 coefficient stays 0)"),
    Rule(("loss.kl_horizon",), lambda c: c.loss.kl_target is None,
         "loss.kl_target is not set (the coefficient is fixed; the horizon paces the adaptive controller only)"),
    # posttrain/loop/targets.py: token rewards get -kl_coef * KL(token) from loss.kl_estimator.
    Rule(("credit.kl_in_reward",), lambda c: c.loss.kl_estimator is None or c.loss.kl_coef == 0,
         "the KL in the reward needs loss.kl_estimator and loss.kl_coef > 0"),
    # posttrain/loop/producer.py ThreadedProducer: only async builds a bounded SampleQueue / interrupts /
    # waits on the queue; sync never queues.
    Rule(("system.max_queue",), lambda c: c.system.mode != "async",
         "only system.mode=async has a queue of finished groups to bound"),
    Rule(("system.interrupt_on_update",), lambda c: c.system.mode != "async",
         "only system.mode=async generates during an update"),
    Rule(("system.queue_timeout_s",), lambda c: c.system.mode == "sync",
         "system.mode=sync waits on no queue (one_step_off and async do)"),
    # producer.py / episode_rollout.py: spans are checked on carried (paused) samples only: those of a
    # partial rollout, or of an async generation paused by an update (engine.pause, interrupt_on_update);
    # sync without partial rollout consumes every sample at the version that sampled it (lag 0).
    Rule(("system.max_version_span",), lambda c: c.system.partial_fraction >= 1.0
         and not (c.system.mode == "async" and c.system.interrupt_on_update),
         "no sample is paused and resumed (needs system.partial_fraction < 1, or system.mode=async with "
         "interrupt_on_update)"),
    Rule(("system.max_staleness",), lambda c: c.system.mode == "sync" and c.system.partial_fraction >= 1.0,
         "in system.mode=sync without partial rollout every sample is consumed at the version that sampled it"),
    # posttrain/loop/run.py: Ray actors are built only with system.backend=ray.
    Rule(("system.ray",), lambda c: c.system.backend != "ray", "system.backend is not ray"),
    # posttrain/loop/parts.py: the Ray reward actors verify single-turn samples (training and held-out); episodes
    # score themselves and their learned rewards are scored in the driver (episode_rollout.py emit), so no actor
    # is started (RunConfig.ray_reward_actors). ray_reward.py: the verify_* keys and the actors' CPUs exist only
    # with actors.
    Rule(("system.ray.num_reward_workers", "system.ray.verify_timeout_s", "system.ray.verify_retries",
          "system.ray.cpus_per_reward_worker"),
         lambda c: c.env.name is not None,
         "env.name is set: the environment scores its own episodes (no Ray reward actor is started)"),
    Rule(("system.ray.verify_timeout_s", "system.ray.verify_retries", "system.ray.cpus_per_reward_worker"),
         lambda c: c.system.ray.num_reward_workers == 0,
         "system.ray.num_reward_workers=0 starts no reward actor (the driver verifies with reward.*)"),
    # posttrain/loop/update.py release_engine -> rollout/engine.py engine_sleep: the Ray rollout workers' pool
    # has no sleep() hook, so the run logged that the engine keeps its memory and went on.
    Rule(("system.engine_sleep",), lambda c: c.system.backend == "ray",
         "the Ray rollout workers (system.backend=ray) have no sleep hook: their engines keep their memory"),
    # posttrain/loop/backends/ray_learner.py: with system.backend=ray the learner ranks (learner.strategy
    # ddp / fsdp2) are Ray actors placed with these keys, and publish their weight buckets (weight_sync);
    # the embedded learner is no actor, its weights are always packed by the driver.
    Rule(("system.ray.cpus_per_learner", "system.ray.gpus_per_learner", "system.ray.learner_resources",
          "system.ray.weight_sync"),
         lambda c: c.learner.strategy == "single",
         "learner.strategy=single runs the learner in the driver (no Ray learner actor)"),
    Rule(("system.ray.learner_timeout_s",), lambda c: True,
         "Ray learner ranks are bounded by learner.rank_timeout_s"),
    # posttrain/loop/builders.py engine_factory: each engine section is read by its engine's factory only
    # (the sections of posttrain/config/engines.py ENGINES).
    *(Rule((f"rollout.{e.section}",), _engine_is_not(e.name), f"rollout.engine is not {e.name}")
      for e in ENGINES.values() if e.section is not None),
    # builders.py engine_factory: rollout.server is read only when the built-in engine runs as a server.
    Rule(("rollout.server",), lambda c: c.rollout.process != "server", "rollout.process is not server"),
    # posttrain/loop/builders.py build_learner_ranks: rank settings exist only when ranks run. The bounds
    # and the bucket size change no arithmetic and are commonly kept in a base recipe whose strategy an
    # override switches: a warning.
    Rule(("learner.device",), lambda c: c.learner.strategy == "single",
         "learner.strategy=single runs no rank processes"),
    Rule(("learner.rank_timeout_s", "learner.startup_timeout_s", "learner.weight_bucket_mb"),
         lambda c: c.learner.strategy == "single", "learner.strategy=single runs no rank processes", "warn"),
    # posttrain/learner (peft): no adapters at rank 0.
    Rule(("lora.alpha", "lora.target_modules", "lora.dropout"), lambda c: c.lora.rank == 0,
         "lora.rank=0 means full fine-tuning (no adapters)"),
    # posttrain/learner/critic.py is built only with critic.enabled.
    Rule(("critic.lr", "critic.shared_backbone", "critic.value_clip"), lambda c: not c.critic.enabled,
         "critic.enabled is false (no critic is built)"),
    # posttrain/loop/producer.py run_dynamic: rounds exist only with dynamic sampling.
    Rule(("sampling.max_sampling_rounds",), lambda c: not c.sampling.dynamic_sampling,
         "sampling.dynamic_sampling is false (no oversampling rounds)"),
    # posttrain/rollout/sampling.py: temperature 0 is argmax decoding (a point mass), whatever the truncation.
    Rule(("sampling.top_k", "sampling.top_p"), lambda c: c.sampling.temperature == 0,
         "sampling.temperature=0 decodes greedily (the argmax is in every top-k / top-p set)"),
    # posttrain/loop/builders.py _replayed_truncation: only a truncating, non-greedy sampler is replayed.
    Rule(("sampling.replay_truncation",),
         lambda c: c.sampling.temperature == 0 or (c.sampling.top_k == 0 and c.sampling.top_p >= 1.0),
         "the sampler does not truncate (top_k=0, top_p=1, or greedy temperature 0)"),
    # posttrain/rewards/scoring.py overlong shaping: no L_max, no penalty.
    Rule(("reward.overlong_cache_len",), lambda c: c.reward.overlong_max_len is None,
         "reward.overlong_max_len is not set (overlong shaping is off)"),
    # posttrain/rewards/compose.py: a component without a weight is recorded but never enters the total, so
    # the penalty would be computed and ignored.
    Rule(("reward.overlong_max_len", "reward.overlong_cache_len"), lambda c: "overlong" not in c.reward.weights,
         "reward.weights has no 'overlong' weight, so the penalty never enters the reward "
         "(add reward.weights.overlong, e.g. {task: 1.0, overlong: 1.0})"),
    # posttrain/loop/builders.py build_task: with env.name the EnvTask replaces the task; the environment
    # scores its episodes itself (no verifier, no extraction, no reward functions, no length shaping).
    Rule(("reward.extract", "reward.functions", "reward.overlong_max_len", "reward.overlong_cache_len"),
         lambda c: c.env.name is not None,
         "env.name is set: the environment scores its own episodes (no task verifier to extend)"),
    # posttrain/loop/run.py: verification goes through a VerifierPool of reward.* unless the Ray reward
    # actors verify (system.ray.verify_*); an environment's episodes are never verified.
    Rule(("reward.workers", "reward.timeout_s", "reward.retries"), lambda c: c.env.name is not None,
         "env.name is set: the environment scores its own episodes (no verifier runs)"),
    Rule(("reward.workers", "reward.timeout_s", "reward.retries"),
         lambda c: c.system.backend == "ray" and c.system.ray.num_reward_workers > 0,
         "the Ray reward actors verify (system.ray.num_reward_workers, verify_timeout_s, verify_retries)"),
    # posttrain/rewards/hidden.py judge_trajectories re-judges single-turn responses (meta response/reference)
    # only; episodes carry neither and evaluate_episodes takes no hidden verifier.
    Rule(("eval.hidden_verifier", "eval.hidden_verifier_kwargs"), lambda c: c.env.name is not None,
         "env.name is set: episodes have no single response and reference for a hidden verifier to re-judge"),
    Rule(("task",), lambda c: c.env.name is not None,
         "env.name is set: episodes replace the single-turn task prompts", "warn"),
    # posttrain/loop/builders.py build_task / episode_rollout.py: env.* is read only with env.name.
    Rule(("env",), lambda c: c.env.name is None, "env.name is not set (single-turn task prompts)"),
    # posttrain/commands/train.py: the SFT warm-up runs only with sft.steps > 0. A warning: shipped
    # recipes with a warm-up (demo, tool_calc) are commonly run with sft.steps=0. The warm-up precedes the trainers
    # that sample (rl, online preference); the others refuse sft.* below, and trainer=sft reads it itself.
    Rule(("sft.batch_size", "sft.lr", "sft.examples", "sft.warmup_draw"), lambda c: _samples(c) and c.sft.steps == 0,
         "sft.steps=0 (no SFT warm-up)", "warn"),
    # posttrain/loop/warmup.py: a single-turn demonstration is one turn, so the two draws are one and the same.
    Rule(("sft.warmup_draw",), lambda c: c.env.name is None,
         "env.name is not set: a single-turn demonstration is one turn (both draws are the same)"),
    # posttrain/loop/sft_training.py: the supervised data and its batching are read by trainer=sft only (the
    # warm-up of the other trainers trains on the task's reference answers).
    Rule(("sft.data", "sft.max_length", "sft.packing", "sft.heldout_data", "sft.heldout_fraction"),
         lambda c: c.trainer != "sft",
         "sft.data and its batching and held-out split are read by trainer=sft only (the other trainers' warm-up, "
         "sft.steps > 0, trains on the task's reference answers)"),
    # posttrain/loop/builders.py build_model: init_seed seeds the random init of builtin tiny presets.
    Rule(("model.init_seed",), _not_builtin_tiny,
         "model.path is not a randomly initialised builtin preset (its weights are loaded)"),
    # posttrain/commands/train.py run(): preference.* is read by trainer=preference
    # (posttrain/loop/preference_training.py, online_preference.py) and trainer=reward_model only.
    Rule(("preference",), lambda c: c.trainer == "rl",
         "trainer=rl trains on verifier rewards; preference.* is read by trainer=preference and trainer=reward_model"),
    # posttrain/loop/preference_training.py (offline): pairs from preference.data, no sampling, no RL update.
    Rule(("preference.online", "preference.pairs_per_group", "preference.loss", "preference.kwargs"),
         lambda c: c.trainer == "reward_model",
         "trainer=reward_model trains a Bradley-Terry reward model (its own loss) on preference.data"),
    Rule(("preference.pairs_per_group",), lambda c: c.trainer == "preference" and not _samples(c),
         "preference.online=false: the pairs come from preference.data, not from sampled groups"),
    # Its Trainer steps AdamW over the bare model (no actor learner): no activation checkpointing.
    Rule(("sampling", "credit", "correction", "loss", "critic", "rollout", "env", "reward", "sft", "system",
          "task.name", "task.kwargs", "guards", "lora", "learner", "optim.ppo_epochs", "optim.num_minibatches",
          "optim.fuse_old_logprob", "optim.skip_no_signal_rows", "optim.share_prompts", "optim.gradient_checkpointing", "eval.size", "eval.heldout_seed",
          "eval.temperature", "eval.sampled_temperature", "eval.max_new_tokens", "eval.reject_drop", "eval.k",
          "eval.hidden_verifier", "eval.hidden_verifier_kwargs"),
         lambda c: c.trainer == "preference" and not _samples(c),
         "trainer=preference (offline) updates the policy on preference.data's pairs with the preference loss "
         "(no sampling, no verifier, no RL update; single process, full fine-tuning, no activation "
         "checkpointing)"),
    # posttrain/loop/online_preference.py: pairs from the task's sampled groups; the preference loss replaces
    # the RL update (no advantages, no critic), single process, full fine-tuning; the SFT warm-up runs as in RL.
    Rule(("preference.data", "preference.fields", "preference.batch_size", "preference.heldout_fraction",
          "preference.max_length"),
         lambda c: c.trainer == "preference" and _samples(c),
         "preference.online=true: the pairs come from the task's sampled groups (task.*, sampling.*)"),
    Rule(("credit", "correction", "loss", "critic", "env", "lora", "learner", "optim.fuse_old_logprob",
          "optim.skip_no_signal_rows", "optim.share_prompts"),
         lambda c: c.trainer == "preference" and _samples(c),
         "trainer=preference updates the policy with the preference loss (preference.loss) on single-turn task "
         "groups (no advantages, no critic, no episodes; single process, full fine-tuning)"),
    # posttrain/loop/guards.py breaches: these read logkappa_abs_max, entropy and adv/zero_group_frac, which the
    # policy learner's RL update and step_metrics log; an online preference step logs none of them.
    Rule(("guards.max_abs_log_kappa", "guards.min_entropy", "guards.max_zero_adv_fraction"),
         lambda c: c.trainer == "preference" and _samples(c),
         "trainer=preference (online) logs no behaviour-vs-learner log-prob check, entropy or advantages for "
         "this guard to read (guards.min_response_length, max_truncation_rate, max_infra_error_fraction act)"),
    # online_preference.py group_pairs: a pair is a correct vs a wrong / invalid response (the task verifier's
    # status); the reward total enters only ODPO's score_diff. Other components are computed and never used.
    Rule(("reward.weights", "reward.functions", "reward.model", "reward.judge", "reward.overlong_max_len",
          "reward.overlong_cache_len"),
         lambda c: c.trainer == "preference" and _samples(c) and c.preference.loss != "odpo",
         "trainer=preference (online) pairs a correct with a wrong response by the task verifier's verdict; the "
         "reward total enters only preference.loss=odpo's score_diff, so this part would be computed and never used"),
    # posttrain/loop/reward_model_training.py: a Bradley-Terry model on preference.data's pairs; no sampling, no
    # verifier, no policy update; one optimizer step per step; held-out pair accuracy every eval.every steps.
    # task.chat_template (the pairs' rendering) and model.* are read.
    # Its Trainer steps AdamW over the bare model: no activation checkpointing.
    Rule(("sampling", "credit", "correction", "loss", "critic", "rollout", "env", "reward", "sft", "system",
          "task.name", "task.kwargs", "task.system_prompt", "guards", "lora", "learner", "optim.ppo_epochs",
          "optim.num_minibatches", "optim.fuse_old_logprob", "optim.skip_no_signal_rows", "optim.share_prompts",
          "optim.gradient_checkpointing", "eval.size", "eval.heldout_seed",
          "eval.temperature", "eval.sampled_temperature", "eval.max_new_tokens", "eval.reject_drop", "eval.k",
          "eval.hidden_verifier", "eval.hidden_verifier_kwargs"),
         lambda c: c.trainer == "reward_model",
         "trainer=reward_model trains a Bradley-Terry reward model on preference.data's pairs (no sampling, no "
         "verifier, no policy update, no activation checkpointing; one optimizer step per step; held-out pair "
         "accuracy every eval.every steps)"),
    # posttrain/loop/sft_training.py: supervised fine-tuning on sft.data's demonstrations for the run's steps with
    # optim.*; no sampling, verifier, reward, pairs or RL update; no warm-up (sft.steps, sft.lr, sft.examples are the
    # RL warm-up's); its Trainer steps AdamW over the bare model (one process, no adapters, no activation
    # checkpointing). model.*, optim.* (less the RL update's keys), sft.* (less the warm-up's), task.chat_template /
    # task.system_prompt (the rendering) and eval.every (held-out loss) are read.
    Rule(("sampling", "credit", "correction", "loss", "critic", "rollout", "env", "reward", "system", "guards", "lora",
          "learner", "preference", "task.name", "task.kwargs", "sft.steps", "sft.lr", "sft.examples",
          "sft.warmup_draw", "optim.ppo_epochs", "optim.num_minibatches", "optim.fuse_old_logprob", "optim.skip_no_signal_rows", "optim.share_prompts",
          "optim.gradient_checkpointing", "eval.size", "eval.heldout_seed", "eval.temperature", "eval.sampled_temperature",
          "eval.max_new_tokens", "eval.reject_drop", "eval.k", "eval.hidden_verifier", "eval.hidden_verifier_kwargs"),
         lambda c: c.trainer == "sft",
         "trainer=sft fine-tunes on sft.data's demonstrations for the run's steps with optim.* (no sampling, no "
         "verifier, no RL update, no warm-up; single process, full fine-tuning, no activation checkpointing)"),
    # posttrain/loop/sft_training.py load_rows: with sft.heldout_data the held-out rows are that file's.
    Rule(("sft.heldout_fraction",), lambda c: c.sft.heldout_data is not None,
         "sft.heldout_data is set (the held-out rows are that file's)"),
    # posttrain/loop/targets.py: with loss.distill.only the teacher's per-token reverse KL is the whole advantage;
    # no estimator runs (credit.*), the critic would train on returns nothing reads, dynamic sampling filters by
    # the verifiable reward, and the reward's weighted total (weights, reward functions, learned rewards, the
    # overlong penalty) is only logged: the task's verdict alone measures the run (as in online preference).
    Rule(("credit.estimator", "credit.kwargs", "credit.kl_in_reward", "critic.enabled", "sampling.dynamic_sampling",
          "reward.weights", "reward.functions", "reward.model", "reward.judge", "reward.overlong_max_len",
          "reward.overlong_cache_len"),
         lambda c: c.loss.distill is not None and c.loss.distill.only,
         "loss.distill.only=true: the teacher's per-token reverse KL is the whole advantage (no estimator, no "
         "returns; the verifiable reward only measures, as the task's verdict); unset it or set "
         "loss.distill.only=false"),
    # posttrain/rewards/judge.py parse_reply: the pattern is read by parse=score only.
    Rule(("reward.judge.score_pattern",), lambda c: c.reward.judge is not None and c.reward.judge.parse != "score",
         "reward.judge.parse is not score (a yes/no reply is read without a pattern)"),
    # posttrain/loop/targets.py fuses_old_logprob: pi_old fused only with one optimizer step per update.
    Rule(("optim.fuse_old_logprob",), lambda c: c.optim.ppo_epochs > 1 or c.optim.num_minibatches > 1
         or c.correction.name is not None or c.credit.kl_in_reward or c.learner.world_size > 1,
         "the update takes more than one optimizer step (or has a correction, KL in the reward or several "
         "ranks): pi_old is always a separate forward", "warn"),
)
"""The table: every key that can be without effect, when, why, and whether it is refused or warned."""


@dataclasses.dataclass(frozen=True)
class GivenKeys:
    """What the user wrote, as dotted keys: ``typed`` on the command line (``key=value`` overrides),
    ``written`` every key and section path of the recipe with its overrides (``None``: not known, e.g. a
    config built in code; then every set key counts as written)."""

    typed: frozenset[str] = frozenset()
    written: frozenset[str] | None = None

    @classmethod
    def of(cls, data: Mapping[str, Any], overrides: Sequence[str] = ()) -> GivenKeys:
        """The keys of a recipe mapping ``data`` (overrides applied) and of the ``overrides`` typed."""
        written: set[str] = set()

        def walk(node: Mapping[str, Any], prefix: str) -> None:
            for k, v in node.items():
                written.add(prefix + str(k))
                if isinstance(v, Mapping):
                    walk(v, f"{prefix}{k}.")

        walk(data, "")
        return cls(frozenset(o.partition("=")[0].strip() for o in overrides), frozenset(written))

    def typed_at(self, key: str) -> bool:
        """Whether ``key`` (a leaf of the config) or a key inside it was typed on the command line."""
        return any(t == key or t.startswith(key + ".") for t in self.typed)


def _default(field: Any) -> Any:
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def unsets(value: Any) -> bool:
    """Whether ``value`` switches a key off (None, False, 0, an empty string / list / dict): typed at the key's
    default, it says what the resolved config does anyway (``reward.overlong_max_len=null`` to drop a recipe's
    shaping), so it is never refused; any other typed default value is (``task.name=arithmetic`` on offline DPO)."""
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0) \
        or (isinstance(value, (str, list, tuple, dict)) and len(value) == 0)


def set_keys(model: BaseModel, prefix: str = "", given: GivenKeys | None = None) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf key the user set to a non-default value, or typed on the command
    line at a value that does not switch it off (``given.typed``, :func:`unsets`; sections recursively through ``model_fields_set``; dicts and
    lists are leaves)."""
    given = given or GivenKeys()
    fields = type(model).model_fields
    for name in sorted(model.model_fields_set):
        if name not in fields:
            continue
        value = getattr(model, name)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            yield from set_keys(value, key + ".", given)
        elif value != _default(fields[name]) or (given.typed_at(key) and not unsets(value)):
            yield key, value


def dead_settings(cfg: RunConfigView, given: GivenKeys | None = None) -> list[tuple[str, Any, str, str]]:
    """``(key, value, why, severity)`` for each set key of ``cfg`` that a rule of :data:`RULES` finds
    without effect (a key's first matching rule; in key order). Keys ``given`` says nobody wrote (derived by
    a validator) are left out when a written key is found: the user is told about what they wrote."""
    given = given or GivenKeys()
    out: list[tuple[str, Any, str, str]] = []
    for key, value in set_keys(cast(BaseModel, cfg), given=given):  # the run config is a pydantic model
        for rule in RULES:
            if any(key == k or key.startswith(k + ".") for k in rule.keys) and rule.dead(cfg):
                out.append((key, value, rule.why, rule.severity))
                break
    if given.written is not None:
        written = [f for f in out if f[0] in given.written]
        if written:
            out = written
    return out


def describe(key: str, value: Any, why: str) -> str:
    """The one-line message of a dead key."""
    return f"{key}={value!r} cannot take effect: {why}"


def check_dead_settings(cfg: RunConfigView, given: GivenKeys | None = None) -> list[str]:
    """Raise ``ValueError`` (one line per refused key, joined by ``; ``) when a set key cannot take
    effect and its rule refuses it; return the warning lines of the keys whose rule only warns
    (``given``: what the user wrote, :func:`dead_settings`)."""
    found = dead_settings(cfg, given)
    errors = [describe(k, v, w) for k, v, w, sev in found if sev == "error"]
    if errors:
        raise ValueError("; ".join(errors))
    warns = [describe(k, v, w) for k, v, w, sev in found if sev == "warn"]
    if "weights" in cfg.reward.model_fields_set and "task" not in cfg.reward.weights:
        # An override reward.weights.K=V replaces the default {task: 1.0}: the verdict would not pay.
        warns.append(f"reward.weights={cfg.reward.weights} has no 'task' weight: the task's verdict does not "
                     "enter the reward (add reward.weights.task=1.0 to keep it)")
    return warns
