"""The algorithm's axes: sampling structure (``sampling``), credit (``credit``), behaviour correction
(``correction``), policy loss and reduction (``loss``), the optimiser (``optim``) and the SFT warm-up (``sft``).

Algorithm names and their ``kwargs`` are checked against the registries of :mod:`posttrain.algos`
by :func:`posttrain.loop.validate.validate_run` (the config holds names, not functions).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from posttrain.config.section import Section


class SamplingConfig(Section):
    """Sampling-structure axis: how many rollouts per prompt and under which sampler."""

    prompts_per_step: int = Field(default=16, ge=1)
    group_size: int = Field(default=8, ge=1, description="G samples per prompt")
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    replay_truncation: bool = Field(
        default=True, description="with top_k > 0 or top_p < 1, the learner's pi_theta / pi_old / pi_ref are the sampler's "
        "truncated distribution (softmax renormalised over the kept set, recomputed from the learner's logits, "
        "the sampled token always kept), so kappa = pi_old / mu stays ~1; false: the full softmax (kappa then "
        "includes the truncation). docs/learner.md")
    max_new_tokens: int = Field(default=16, ge=1)
    dynamic_sampling: bool = Field(default=False, description="DAPO: drop groups whose rewards are all equal and oversample")
    max_sampling_rounds: int = Field(default=4, ge=1, description="oversampling rounds before giving up filling the batch")


class CreditConfig(Section):
    """Credit axis: the advantage / return estimator."""

    estimator: str = Field(default="grpo", description="a name in posttrain.algos.ADVANTAGES, or 'package.module:function' "
                           "(same signature; checked at config load)")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    kl_in_reward: bool = Field(default=False, description="subtract kl_coef * KL(token) from token rewards (PPO style)")


class CorrectionConfig(Section):
    """Behavior-correction axis (train/inference mismatch, staleness)."""

    name: str | None = Field(default=None, description="a name in posttrain.algos.CORRECTIONS, or None")
    kwargs: dict[str, Any] = Field(default_factory=dict)


class DistillConfig(Section):
    """On-policy distillation (``loss.distill``): a frozen teacher scores the student's own samples and
    ``-coef * (log pi_old - log pi_teacher)`` of each sampled token is added to its advantage (the
    per-token reverse-KL signal of Agarwal et al. 2024, GKD, arXiv:2306.13649, and Gu et al. 2024,
    MiniLLM, arXiv:2306.08543). docs/learner.md "On-policy distillation"."""

    teacher: str = Field(description="the teacher: a checkpoint's actor/ directory, a Hugging Face model directory, or "
                         "builtin:NAME; its tokenizer must equal the student's (refused before the run starts)")
    coef: float = Field(default=1.0, gt=0.0, description="weight of the per-token reverse-KL advantage")
    only: bool = Field(default=False, description="true: the reverse KL to the teacher is the whole learning signal "
                       "(the verifier still scores every sample for the metrics; credit.estimator is not run); "
                       "false: it is added to the estimator's advantages of the verifiable reward")

    @field_validator("teacher")
    @classmethod
    def _teacher_named(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("loss.distill.teacher is empty: give a checkpoint's actor/ directory, a Hugging Face "
                             "model directory or builtin:NAME")
        return v


class LossConfig(Section):
    """Policy loss and the reduction axis."""

    policy_loss: str = Field(default="ppo_clip", description="a name in posttrain.algos.POLICY_LOSSES, or "
                             "'package.module:function' (same signature; checked at config load)")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    reduction: str = Field(default="token_mean", description="a name in posttrain.algos.REDUCTIONS")
    kl_estimator: str | None = Field(default=None, description="a name in KL_ESTIMATORS; None = no reference model")
    kl_coef: float = Field(default=0.0, ge=0.0)
    kl_target: float | None = Field(default=None, gt=0, description="adaptive KL controller target, in the logged KL's "
                                    "unit (mean per-token estimate: `kl`, or `kl/ref_mean` with credit.kl_in_reward); "
                                    "kl_coef is its starting beta (None = fixed coef; Ziegler et al. 2019)")
    kl_horizon: int = Field(default=10000, ge=1, description="adaptive KL controller horizon in samples (sequences, as in "
                            "Ziegler et al. 2019's code): each step beta *= 1 + min(n/kl_horizon, 1) * "
                            "clip(kl/kl_target - 1, -0.2, 0.2), n = prompts_per_step * group_size")
    entropy_coef: float = Field(default=0.0)
    mask_truncated: bool = Field(
        default=False, description="DAPO's overlong filtering (Yu et al. 2025, sec. 3.4): rows that ended truncated "
        "(cut at sampling.max_new_tokens, or an episode ended by a limit) get no policy-loss token; their rewards "
        "still enter their groups' advantages. Counted as truncated_rows_masked (docs/learner.md)")
    distill: DistillConfig | None = Field(default=None, description="on-policy distillation from a frozen teacher "
                                          "(None = off)")


class OptimConfig(Section):
    """Optimiser and update schedule."""

    lr: float = Field(default=1e-3, ge=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(default=0, ge=0, description="learning-rate warm-up in optimizer steps, not RL steps: an "
                              "RL step takes ppo_epochs x num_minibatches of them (offline preference and reward-model "
                              "trainers: one per step)")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="learning-rate decay after the warm-up, over steps x ppo_epochs x "
        "num_minibatches optimizer steps (posttrain/learner/schedule.py)")
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    microbatch_tokens: int = Field(default=4096, ge=1, description="token budget per micro-batch (rows x padded length)")
    gradient_checkpointing: bool = Field(
        default=False, description="recompute the policy's layer activations in the backward instead of keeping them "
        "(transformers' gradient checkpointing; needs a model without dropout): lower peak memory per micro-batch "
        "for one more forward of the backbone (measured: docs/benchmarks.md, `posttrain bench memory`)")
    share_prompts: bool = Field(
        default=False, description="the RL update's forward runs each distinct prompt of a micro-batch once and its "
        "responses against a copy of its KV cache (a GRPO group's G samples share one prompt forward; Prefix "
        "Grouper, Liu et al. 2025): the same log-probs and gradients up to float rounding, fewer tokens through the "
        "model (docs/learner.md); needs a model with a plain linear LM head (llama / mistral / qwen2 / qwen3), not "
        "with gradient_checkpointing or learner.strategy=fsdp2")
    ppo_epochs: int = Field(default=1, ge=1)
    num_minibatches: int = Field(default=1, ge=1)
    fuse_old_logprob: bool = Field(
        default=True, description="with exactly one optimizer step per update (ppo_epochs=1, num_minibatches=1, no "
        "correction, no KL in the reward) take pi_old from the update's own forward instead of a separate "
        "no-grad forward (same weights: identical up to float rounding; recorded in the ledger as before)")
    skip_no_signal_rows: bool = Field(
        default=True, description="rows whose advantage is 0 on every token (e.g. a GRPO group with equal rewards) are "
        "forwarded without grad and left out of the backward when that is exact: the policy loss vanishes at A=0 "
        "(probed), no KL loss, entropy_coef=0 (docs/learner.md); counted as no_signal_rows")


class SFTConfig(Section):
    """Supervised fine-tuning: the RL runs' warm-up on the task's reference answers (``sft.steps`` > 0 with
    ``trainer: rl``), and ``trainer: sft`` on a file of demonstrations (``sft.data``; docs/sft.md).

    ``trainer: sft`` takes the run's ``steps`` (not ``sft.steps``) and ``optim.*`` (not ``sft.lr``: the whole
    AdamW and schedule of the other trainers), ``sft.batch_size`` rows per step, and the keys below ``data``;
    the warm-up reads ``steps``, ``batch_size``, ``lr``, ``examples`` and ``warmup_draw`` of this section and none
    below."""

    steps: int = Field(default=0, ge=0, description="RL warm-up steps before the first RL step (0 = no warm-up); "
                       "trainer=sft counts its steps with the run's steps instead")
    batch_size: int = Field(default=64, ge=1, description="demonstrations per step (warm-up and trainer=sft)")
    lr: float = Field(default=3e-3, gt=0, description="the warm-up's learning rate (trainer=sft: optim.lr)")
    examples: int = Field(default=2000, ge=1, description="distinct training examples the warm-up sees")
    warmup_draw: Literal["demonstration", "turn"] = Field(
        default="demonstration", description="with env.name, what the warm-up draws sft.batch_size of per step: "
        "whole demonstrations, each with all its turns (a call and the answer that follows it in the same step), or "
        "single turns (the draw before 2026-12-07, which tool_calc's measured curve was made with)")
    data: str | None = Field(
        default=None, description="trainer=sft: a JSONL or Parquet file of demonstrations, each row a chat "
        "({messages: [{role, content}, ...]}) or a prompt-completion pair ({prompt, completion}: two strings, or two "
        "lists of messages); posttrain/envs/sft_data.py")
    heldout_data: str | None = Field(default=None, description="trainer=sft: a file of held-out rows (same formats); "
                                     "None = hold out sft.heldout_fraction of sft.data")
    heldout_fraction: float = Field(
        default=0.1, gt=0, lt=1, description="trainer=sft without sft.heldout_data: the rows held out of sft.data, "
        "split by a hash of each row's prompt (the same in every run and seed; rows sharing a prompt stay together)")
    max_length: int = Field(default=1024, ge=2, description="trainer=sft: tokens of one rendered row (and of one "
                            "packed block); a longer row is refused at load, naming its file and row")
    packing: bool = Field(default=False, description="trainer=sft: pack each step's rows into blocks of "
                          "sft.max_length tokens (positions restart per row, no attention across rows) instead of "
                          "padding them; the same loss, less padding")
