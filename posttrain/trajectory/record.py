"""The per-trajectory record: every token accounted for.

Per token (arrays of the flattened sequence length ``L``; value at index ``t`` concerns token
``t`` itself, i.e. ``behavior_logprob[t] = log mu(token_t | tokens_<t)``):

- ``token_ids`` int64, ``roles`` (:class:`Role`), ``action_mask`` int8 (1 only on ACTION tokens)
- ``behavior_logprob`` float64: exact log-prob under the distribution that sampled the token
  (engine + sampler after temperature / top-p / top-k renormalisation); 0.0 where not an action
- ``behavior_version`` int64: the engine version that sampled the token, -1 where not an action
  (a paused-and-resumed trajectory spans versions)
- ``old_logprob`` / ``ref_logprob`` float64 or ``None`` until the learner freezes them; 0.0 where
  not an action. Their ``old_version`` / ``ref_version`` are one integer per trajectory: the
  learner recomputes a whole sequence in one forward pass under one version.
- ``teacher_logprob`` float64 or ``None``: the frozen distillation teacher's log-prob of each token
  (``loss.distill``; computed like ``ref_logprob``, no version: the teacher never changes); 0.0 where
  not an action
- ``current_logprob`` float64 or ``None``: pi_theta as the update saw it (the forward of the last
  optimiser step that held the token, before that step; with one step per update it equals
  ``old_logprob``), so ``rho = exp(current - old)`` can be audited; 0.0 where not an action
- ``advantage`` float64 or ``None``: the per-token advantage the update used; 0.0 where not an action

Per trajectory: ids, group, env seed / snapshot, sampling config + RNG seed, raw reward
components + weights + total, ``verifier`` ``name@version``, ``status``, ``finish``, timings,
policy lag at consumption, and a free ``meta`` dict of JSON scalars (prompt text, answer...).
A multi-turn episode also carries its step record (:class:`StepRecord`, GiGPO's per-step inputs):
each policy turn's anchor-state hash, weighted reward and action-token count.
An evaluation-only verifier's verdict, when one is attached (``eval.hidden_verifier``), sits beside
the training verifier's: ``hidden_verifier`` ``name@version`` and ``hidden_status``; it never
touches the reward.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from posttrain.trajectory.enums import Finish, Role, Status

JSONScalar = str | int | float | bool | None


class TrajectoryError(ValueError):
    """A trajectory violates the contract; the message names the trajectory and field."""


@dataclasses.dataclass(frozen=True)
class Reward:
    """Raw, unweighted components, their weights, and ``total = sum(w_k * c_k)``.

    ``total`` is ``None`` when the trajectory has no valid reward (``infra_error`` or not yet
    scored): it must never be replaced by zero.
    """

    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    total: float | None = None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """The steps (policy turns) of a multi-turn episode, one entry per step in order.

    ``anchors[t]``: hash of the environment state step ``t`` was taken in (GiGPO's anchor state,
    Feng et al. 2025, arXiv:2505.10978); ``rewards[t]``: the weighted reward of step ``t``;
    ``action_tokens[t]``: how many action tokens step ``t`` produced (so the action tokens of a
    trajectory split into steps in order). An episode the environment broke mid-step may hold one
    anchor more than rewards; the step-level estimator refuses such a record.
    """

    anchors: tuple[int, ...] = ()
    rewards: tuple[float, ...] = ()
    action_tokens: tuple[int, ...] = ()


def _arr(x: Any, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    a = np.asarray(x, dtype=dtype)
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
    """One trajectory of the contract; validated on construction (see module docstring)."""

    traj_id: str
    prompt_id: str
    group_id: str
    token_ids: npt.NDArray[np.int64]
    roles: tuple[Role, ...]
    action_mask: npt.NDArray[np.int8]
    behavior_logprob: npt.NDArray[np.float64]
    behavior_version: npt.NDArray[np.int64]
    finish: Finish
    status: Status | None = None
    reward: Reward = dataclasses.field(default_factory=Reward)
    verifier: str | None = None
    old_logprob: npt.NDArray[np.float64] | None = None
    old_version: int | None = None
    ref_logprob: npt.NDArray[np.float64] | None = None
    ref_version: int | None = None
    env_seed: int | None = None
    snapshot_id: str | None = None
    sampling: Mapping[str, JSONScalar] = dataclasses.field(default_factory=dict)
    rng_seed: int | None = None
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    policy_lag: int | None = None
    meta: Mapping[str, JSONScalar] = dataclasses.field(default_factory=dict)
    current_logprob: npt.NDArray[np.float64] | None = None
    advantage: npt.NDArray[np.float64] | None = None
    hidden_verifier: str | None = None
    hidden_status: Status | None = None
    steps: StepRecord | None = None  # multi-turn episodes only
    teacher_logprob: npt.NDArray[np.float64] | None = None  # loss.distill only

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        built = _STRUCTURE_BUILT.get()
        set_(self, "token_ids", _arr(self.token_ids, np.int64))
        if not built:
            set_(self, "roles", tuple(Role(r) for r in self.roles))
        set_(self, "action_mask", _arr(self.action_mask, np.int8))
        set_(self, "behavior_logprob", _arr(self.behavior_logprob, np.float64))
        set_(self, "behavior_version", _arr(self.behavior_version, np.int64))
        set_(self, "finish", Finish(self.finish))
        if self.status is not None:
            set_(self, "status", Status(self.status))
        if self.hidden_status is not None:
            set_(self, "hidden_status", Status(self.hidden_status))
        for name in ("old_logprob", "ref_logprob", "current_logprob", "advantage", "teacher_logprob"):
            v = getattr(self, name)
            if v is not None:
                set_(self, name, _arr(v, np.float64))
        if built:  # make_trajectory laid out roles / mask / -1 versions consistently itself
            self._validate_token_ids()
            self._validate_action_versions(self.action_mask.astype(bool))
            self._validate_arrays(_LOGPROB_ARRAYS)
            self._validate_scalars()
        else:
            self.validate()

    # ------------------------------------------------------------------ validation
    def _fail(self, field: str, msg: str) -> TrajectoryError:
        return TrajectoryError(f"trajectory {self.traj_id!r}: field {field!r}: {msg}")

    def validate(self) -> None:
        """Check the contract; raise :class:`TrajectoryError` naming trajectory and field."""
        self._validate_structure()
        self._validate_arrays(_LOGPROB_ARRAYS)
        self._validate_scalars()

    def _validate_structure(self) -> None:
        """token_ids / roles / action_mask / behavior_version and every per-token array's shape."""
        L = self._validate_token_ids()
        for name in ("action_mask", "behavior_version"):
            v = getattr(self, name)
            if v.shape != (L,):
                raise self._fail(name, f"has shape {v.shape}, token_ids has ({L},)")
        if len(self.roles) != L:
            raise self._fail("roles", f"has length {len(self.roles)}, token_ids has {L}")
        am = self.action_mask
        if not ((am == 0) | (am == 1)).all():
            raise self._fail("action_mask", "must hold only 0 and 1")
        is_action = np.fromiter((r is Role.ACTION for r in self.roles), dtype=bool, count=L)
        act = am.astype(bool)
        bad = np.flatnonzero(is_action != act)
        if bad.size:
            raise self._fail("action_mask", f"disagrees with roles at token {int(bad[0])} (1 only on action tokens)")
        self._validate_action_versions(act)
        if (self.behavior_version[~act] != -1).any():
            raise self._fail("behavior_version", "must be -1 on non-action tokens")

    def _validate_token_ids(self) -> int:
        """token_ids is 1-D and not empty; returns its length."""
        if self.token_ids.ndim != 1:
            raise self._fail("token_ids", f"must be 1-D, got shape {self.token_ids.shape}")
        L = int(self.token_ids.shape[0])
        if L == 0:
            raise self._fail("token_ids", "is empty")
        return L

    def _validate_action_versions(self, act: npt.NDArray[np.bool_]) -> None:
        """Every action token (``act``) was sampled by a real policy version (>= 0)."""
        if act.any() and (self.behavior_version[act] < 0).any():
            raise self._fail("behavior_version", "must be >= 0 on action tokens")

    def _validate_arrays(self, names: Sequence[str]) -> None:
        """The float per-token arrays in ``names``: shape ``(L,)``, finite on action tokens, log-probs
        ``<= 0`` there (the advantage may have any sign), exactly 0 on every other token."""
        L = int(self.token_ids.shape[0])
        act: npt.NDArray[np.bool_] | None = None
        for name in names:
            v = getattr(self, name)
            if v is None:
                continue
            if v.shape != (L,):
                raise self._fail(name, f"has shape {v.shape}, token_ids has ({L},)")
            if act is None:
                act = self.action_mask.astype(bool)
            on = v[act]
            if not np.isfinite(on).all():
                raise self._fail(name, f"not finite at action token {int(np.flatnonzero(act)[~np.isfinite(on)][0])}")
            if name != "advantage" and (on > 0).any():
                raise self._fail(name, f"log-prob > 0 at action token {int(np.flatnonzero(act)[on > 0][0])}")
            if (v[~act] != 0).any():
                raise self._fail(name, "must be 0.0 on non-action tokens")

    def _validate_scalars(self) -> None:
        """Per-trajectory fields: versions beside frozen log-probs, reward vs status, verifier labels."""
        if self.old_logprob is not None and self.old_version is None:
            raise self._fail("old_version", "old_logprob is set without its version")
        if self.ref_logprob is not None and self.ref_version is None:
            raise self._fail("ref_version", "ref_logprob is set without its version")
        if self.status is Status.INFRA_ERROR and self.reward.total is not None:
            raise self._fail("reward.total", "an infra_error trajectory has no reward (never zero)")
        if self.reward.total is not None and not math.isfinite(self.reward.total):
            raise self._fail("reward.total", f"not finite: {self.reward.total}")
        for name in ("verifier", "hidden_verifier"):
            v = getattr(self, name)
            if v is not None and "@" not in v:
                raise self._fail(name, f"must be 'name@version', got {v!r}")
        if self.hidden_status is not None and self.hidden_verifier is None:
            raise self._fail("hidden_verifier", "hidden_status is set without the verifier that gave it")

    # ------------------------------------------------------------------ helpers
    @property
    def length(self) -> int:
        """Flattened sequence length ``L`` (prompt + actions + observations)."""
        return int(self.token_ids.shape[0])

    @property
    def num_actions(self) -> int:
        """Number of policy-generated tokens."""
        return int(self.action_mask.sum())

    @property
    def prompt_length(self) -> int:
        """Tokens before the first action token (the whole length if none)."""
        idx = np.flatnonzero(self.action_mask)
        return int(idx[0]) if idx.size else self.length

    @property
    def version_span(self) -> int:
        """max - min behavior version over action tokens (0 for a single-version trajectory)."""
        v = self.behavior_version[self.action_mask.astype(bool)]
        return int(v.max() - v.min()) if v.size else 0

    def replace(self, **changes: Any) -> Trajectory:
        """A validated copy with ``changes`` applied (records are immutable).

        The copy passes the same checks as a new record; what ``changes`` cannot have touched is not
        checked again: with the token structure (``token_ids``, ``roles``, ``action_mask``,
        ``behavior_version``) unchanged, only the changed float arrays and the per-trajectory fields
        are (the loop replaces every record two or three times per step)."""
        unknown = set(changes) - _FIELD_NAMES
        if unknown or _STRUCTURE & set(changes):
            return dataclasses.replace(self, **changes)  # full construction (and its TypeError on a bad name)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        set_ = object.__setattr__
        for name, v in changes.items():
            if name in _LOGPROB_ARRAYS and v is not None:
                v = _arr(v, np.float64)
            elif name in ("status", "hidden_status") and v is not None:
                v = Status(v)
            elif name == "finish":
                v = Finish(v)
            set_(new, name, v)
        new._validate_arrays([n for n in _LOGPROB_ARRAYS if n in changes])
        new._validate_scalars()
        return new

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or a.shape != b.shape or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


# Set by make_trajectory while it constructs a record whose token structure (roles, action mask, -1
# versions off the actions) it built itself: __post_init__ then checks only what the caller supplied.
_STRUCTURE_BUILT: contextvars.ContextVar[bool] = contextvars.ContextVar("posttrain_structure_built", default=False)
_LOGPROB_ARRAYS = ("behavior_logprob", "old_logprob", "ref_logprob", "current_logprob", "advantage",
                   "teacher_logprob")
_STRUCTURE = frozenset({"token_ids", "roles", "action_mask", "behavior_version"})
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Trajectory))


def make_trajectory(
    *,
    traj_id: str,
    prompt_id: str,
    group_id: str,
    prompt_ids: Sequence[int],
    action_ids: Sequence[int],
    action_logprobs: Sequence[float],
    action_versions: Sequence[int] | int,
    finish: Finish | str,
    **rest: Any,
) -> Trajectory:
    """Build a single-turn trajectory ``prompt ++ actions`` with the masks filled in."""
    P, A = len(prompt_ids), len(action_ids)
    if len(action_logprobs) != A:
        raise TrajectoryError(
            f"trajectory {traj_id!r}: field 'behavior_logprob': {len(action_logprobs)} log-probs for {A} actions"
        )
    versions = [action_versions] * A if isinstance(action_versions, int) else list(action_versions)
    if len(versions) != A:
        raise TrajectoryError(
            f"trajectory {traj_id!r}: field 'behavior_version': {len(versions)} versions for {A} actions"
        )
    if "roles" in rest or "action_mask" in rest or "behavior_version" in rest or "token_ids" in rest:
        raise TypeError("make_trajectory lays out token_ids / roles / action_mask / behavior_version itself")
    token = _STRUCTURE_BUILT.set(True)
    try:
        return Trajectory(
            traj_id=traj_id,
            prompt_id=prompt_id,
            group_id=group_id,
            token_ids=np.asarray([*prompt_ids, *action_ids], dtype=np.int64),
            roles=(Role.PROMPT,) * P + (Role.ACTION,) * A,
            action_mask=np.asarray([0] * P + [1] * A, dtype=np.int8),
            behavior_logprob=np.asarray([0.0] * P + list(action_logprobs), dtype=np.float64),
            behavior_version=np.asarray([-1] * P + versions, dtype=np.int64),
            finish=Finish(finish),
            **rest,
        )
    finally:
        _STRUCTURE_BUILT.reset(token)
