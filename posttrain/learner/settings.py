"""The learners' typed settings: frozen dataclasses, one per concern, shared where the concern is.

Every learner (policy, critic, SFT) reads :class:`OptimizerSettings` (AdamW and its schedule) and
:class:`BatchingSettings` (epochs x mini-batches x token-budget micro-batches, the shuffle seed) through
the one :class:`~posttrain.learner.trainer.Trainer`; the policy learner adds :class:`PolicyLossSettings`,
:class:`SamplerReplay`, :class:`ComputeSettings` and :class:`LoraSettings`. The loop builds them from the
recipe (``posttrain.loop.builders.build_learner``).

The flat keyword arguments the learners took before these settings existed (``lr=``, ``ppo_epochs=``,
``lora_rank=`` ...) are still accepted, typed by :class:`FlatPolicyArgs` / :class:`FlatCriticArgs`, and
mapped onto the settings here (:func:`policy_settings`, :func:`critic_settings`); a flat argument
overrides the field of the settings object it belongs to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Settings = TypeVar("_Settings", bound="DataclassInstance")

#: Keyword arguments of a registry function (a policy loss, reduction or correction), as the recipe gives
#: them; the learner calls the function with them as validated by its typed model (``Registry.validate_kwargs``).
RegistryKwargs = Mapping[str, object]


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """AdamW (``lr``, ``betas``, ``adam_eps``, ``weight_decay``), the learning-rate schedule of
    :mod:`posttrain.learner.schedule` (``lr_schedule``, ``warmup_steps``, ``total_steps`` in optimiser
    steps, ``min_lr_ratio``) and the global gradient-norm clip (``max_grad_norm``; ``None``: measure only)."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    total_steps: int | None = None
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0


@dataclasses.dataclass(frozen=True)
class BatchingSettings:
    """How one update walks its batch: ``epochs`` passes, each a fresh shuffle (seeded by ``seed``) cut
    into ``num_minibatches`` mini-batches (one optimiser step each), each run as micro-batches of at most
    ``microbatch_tokens`` padded tokens (``None``: the whole mini-batch in one pass)."""

    epochs: int = 1
    num_minibatches: int = 1
    microbatch_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {self.num_minibatches}")
        if self.microbatch_tokens is not None and self.microbatch_tokens < 1:
            raise ValueError(f"microbatch_tokens must be >= 1 or None, got {self.microbatch_tokens}")


@dataclasses.dataclass(frozen=True)
class PolicyLossSettings:
    """The policy objective: registry names and their keyword arguments (``policy_loss`` in
    ``POLICY_LOSSES``, ``reduction`` in ``REDUCTIONS``, ``kl_estimator`` in ``KL_ESTIMATORS`` or ``None``,
    ``correction`` in ``CORRECTIONS`` or ``None``), the entropy bonus ``entropy_coef``, whether the token
    entropy is reported when it is not trained (``compute_entropy``), and whether rows without signal skip
    the backward (``skip_no_signal_rows``, see :meth:`PolicyLearner.no_signal_rows_skippable`), and whether
    truncated rows are masked out of the loss (``mask_truncated``: DAPO's overlong filtering)."""

    policy_loss: str = "ppo_clip"
    policy_loss_kwargs: RegistryKwargs = dataclasses.field(default_factory=dict)
    reduction: str = "token_mean"
    reduction_kwargs: RegistryKwargs = dataclasses.field(default_factory=dict)
    kl_estimator: str | None = None
    entropy_coef: float = 0.0
    correction: str | None = None
    correction_kwargs: RegistryKwargs = dataclasses.field(default_factory=dict)
    compute_entropy: bool = True
    skip_no_signal_rows: bool = True
    mask_truncated: bool = False


@dataclasses.dataclass(frozen=True)
class SamplerReplay:
    """The sampler's distribution the learner's log-probs replay: ``temperature`` (> 0, equal to the
    sampler's) and the truncation ``top_k`` (0: off) / ``top_p`` (1: off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True)
class ComputeSettings:
    """How the forward runs: ``autocast_dtype`` (``"bfloat16"`` / ``"float16"``; ``None``: the model's
    dtype), ``entropy_chunk_size`` (rows of logits per entropy chunk; ``None``: all at once),
    ``gradient_checkpointing`` (needs a model without dropout) and ``share_prompts`` (the update's forward runs
    each distinct prompt once: :mod:`posttrain.learner.shared_prompt`; not with checkpointing)."""

    autocast_dtype: str | None = None
    entropy_chunk_size: int | None = None
    gradient_checkpointing: bool = False
    share_prompts: bool = False

    def __post_init__(self) -> None:
        if self.share_prompts and self.gradient_checkpointing:
            raise ValueError("share_prompts needs the model's KV cache, which gradient checkpointing turns off in "
                             "the gradient forward: set one of them")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """peft LoRA adapters (Hu et al. 2021, arXiv:2106.09685): ``rank`` 0 = full fine-tuning."""

    rank: int = 0
    alpha: float | None = None
    target_modules: Sequence[str] | str | None = None
    dropout: float = 0.0


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """All settings of a :class:`~posttrain.learner.actor.PolicyLearner`."""

    optim: OptimizerSettings = OptimizerSettings()
    batching: BatchingSettings = BatchingSettings()
    loss: PolicyLossSettings = PolicyLossSettings()
    sampler: SamplerReplay = SamplerReplay()
    compute: ComputeSettings = ComputeSettings()
    lora: LoraSettings = LoraSettings()


class FlatOptimizerArgs(TypedDict, total=False):
    """The flat keyword form of :class:`OptimizerSettings` (same names)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    adam_eps: float
    warmup_steps: int
    total_steps: int | None
    lr_schedule: str
    min_lr_ratio: float
    max_grad_norm: float | None


class FlatCriticArgs(FlatOptimizerArgs, total=False):
    """The critic's flat keyword arguments: :class:`OptimizerSettings` and :class:`BatchingSettings`."""

    epochs: int
    num_minibatches: int
    microbatch_tokens: int | None
    seed: int


class FlatPolicyArgs(FlatOptimizerArgs, total=False):
    """The policy learner's flat keyword arguments (``ppo_epochs`` is ``BatchingSettings.epochs``,
    ``lora_*`` are :class:`LoraSettings` fields)."""

    microbatch_tokens: int | None
    ppo_epochs: int
    num_minibatches: int
    seed: int
    policy_loss: str
    policy_loss_kwargs: RegistryKwargs | None
    reduction: str
    reduction_kwargs: RegistryKwargs | None
    kl_estimator: str | None
    entropy_coef: float
    correction: str | None
    correction_kwargs: RegistryKwargs | None
    compute_entropy: bool
    skip_no_signal_rows: bool
    mask_truncated: bool
    temperature: float
    top_k: int
    top_p: float
    autocast_dtype: str | None
    entropy_chunk_size: int | None
    gradient_checkpointing: bool
    share_prompts: bool
    lora_rank: int
    lora_alpha: float | None
    lora_target_modules: Sequence[str] | str | None
    lora_dropout: float


# flat name -> (settings group, field); the groups are PolicySettings' fields.
_POLICY_FLAT: dict[str, tuple[str, str]] = {
    **{f.name: ("optim", f.name) for f in dataclasses.fields(OptimizerSettings)},
    "ppo_epochs": ("batching", "epochs"), "num_minibatches": ("batching", "num_minibatches"),
    "microbatch_tokens": ("batching", "microbatch_tokens"), "seed": ("batching", "seed"),
    **{f.name: ("loss", f.name) for f in dataclasses.fields(PolicyLossSettings)},
    **{f.name: ("sampler", f.name) for f in dataclasses.fields(SamplerReplay)},
    **{f.name: ("compute", f.name) for f in dataclasses.fields(ComputeSettings)},
    **{f"lora_{f.name}": ("lora", f.name) for f in dataclasses.fields(LoraSettings)},
}
_KWARGS_FIELDS = ("policy_loss_kwargs", "reduction_kwargs", "correction_kwargs")


def policy_settings(base: PolicySettings, flat: FlatPolicyArgs) -> PolicySettings:
    """``base`` with every flat argument of ``flat`` written into its group (a ``None`` registry
    kwargs mapping reads as empty); an unknown name raises ``TypeError`` as a wrong keyword would."""
    changes: dict[str, dict[str, object]] = {}
    for name, value in flat.items():
        if name not in _POLICY_FLAT:
            raise TypeError(f"PolicyLearner() got an unexpected keyword argument {name!r}")
        group, field = _POLICY_FLAT[name]
        changes.setdefault(group, {})[field] = dict(value or {}) if field in _KWARGS_FIELDS else value  # type: ignore[call-overload]
    return _replaced(base, {g: _replaced(getattr(base, g), c) for g, c in changes.items()})


def critic_settings(
    optim: OptimizerSettings, batching: BatchingSettings, flat: FlatCriticArgs
) -> tuple[OptimizerSettings, BatchingSettings]:
    """``(optim, batching)`` with the flat arguments of ``flat`` written into them."""
    optim_names = {f.name for f in dataclasses.fields(OptimizerSettings)}
    batching_names = {f.name for f in dataclasses.fields(BatchingSettings)}
    unknown = set(flat) - optim_names - batching_names
    if unknown:
        raise TypeError(f"CriticLearner() got unexpected keyword arguments {sorted(unknown)}")
    return (
        _replaced(optim, {k: v for k, v in flat.items() if k in optim_names}),
        _replaced(batching, {k: v for k, v in flat.items() if k in batching_names}),
    )


def _replaced(settings: _Settings, changes: Mapping[str, object]) -> _Settings:
    """``settings`` with the fields named in ``changes`` replaced (the dataclass re-validates)."""
    return dataclasses.replace(settings, **changes)


__all__ = [
    "BatchingSettings",
    "ComputeSettings",
    "FlatCriticArgs",
    "FlatOptimizerArgs",
    "FlatPolicyArgs",
    "LoraSettings",
    "OptimizerSettings",
    "PolicyLossSettings",
    "PolicySettings",
    "RegistryKwargs",
    "SamplerReplay",
]
