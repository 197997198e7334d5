"""Requests and completions of a rollout engine, and their lossless trajectory conversion."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from posttrain.rollout.sampling import SamplingParams
from posttrain.trajectory import Finish, Trajectory, make_trajectory

FINISH_REASONS = ("eos", "stop", "length", "paused")

# eos and stop are natural ends of the episode; length is a cut (value targets must bootstrap);
# paused will be resumed (partial rollout).
_FINISH_OF_REASON: dict[str, Finish] = {
    "eos": Finish.TERMINAL,
    "stop": Finish.TERMINAL,
    "length": Finish.TRUNCATED,
    "paused": Finish.PAUSED,
}


@dataclasses.dataclass
class GenerationRequest:
    """One prompt to sample ``params.n`` completions of.

    With ``resume`` set (a ``"paused"`` :class:`Completion` of this request), the request
    continues that one sample instead: it yields exactly one completion with the same
    ``sample_index`` and seed, whose tokens, log-probs and versions extend the paused ones, and
    ``params.max_new_tokens`` bounds the total over all segments.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    resume: Completion | None = None


@dataclasses.dataclass
class Completion:
    """One sampled continuation; per generated token its id, behaviour log-prob and version.

    ``logprobs[i] = log mu(token_ids[i] | prompt, token_ids[:i])`` under the distribution that
    sampled it (see :mod:`posttrain.rollout.sampling`), ``versions[i]`` the engine version whose
    weights produced it. ``full_logprobs [len(token_ids), V]`` float64 is the whole ``log mu``
    row of each step when requested (``-inf`` outside the kept set). ``seed`` is the effective
    seed of the sample's random stream (drawn by the engine when the request had none).
    """

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    full_logprobs: torch.Tensor | None = None
    params: SamplingParams | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"request {self.request_id!r}: finish_reason {self.finish_reason!r} not one of {FINISH_REASONS}"
            )
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"request {self.request_id!r}: {len(self.token_ids)} tokens, {len(self.logprobs)} log-probs, "
                f"{len(self.versions)} versions (must be equal)"
            )

    @property
    def finished(self) -> bool:
        """Whether the sample ended (anything but ``"paused"``)."""
        return self.finish_reason != "paused"

    def to_trajectory(self, *, traj_id: str, prompt_id: str, group_id: str, **rest: Any) -> Trajectory:
        """A single-turn :class:`Trajectory` ``prompt ++ tokens`` holding every field of the completion.

        ``finish``: eos/stop -> TERMINAL, length -> TRUNCATED, paused -> PAUSED; ``sampling`` =
        ``params.to_record()``, ``rng_seed`` = ``seed``; ``meta`` gains ``request_id``,
        ``sample_index`` and ``finish_reason`` (eos and stop share TERMINAL, so the reason is
        kept there) so :meth:`from_trajectory` restores the completion exactly (except
        ``full_logprobs``, which the contract does not store). ``rest`` goes to
        :func:`make_trajectory` (reward, status, env seed, ...).
        """
        meta = dict(rest.pop("meta", {}))
        meta.update(request_id=self.request_id, sample_index=self.sample_index, finish_reason=self.finish_reason)
        rest.setdefault("sampling", self.params.to_record() if self.params is not None else {})
        rest.setdefault("rng_seed", self.seed)
        return make_trajectory(
            traj_id=traj_id,
            prompt_id=prompt_id,
            group_id=group_id,
            prompt_ids=self.prompt_ids,
            action_ids=self.token_ids,
            action_logprobs=self.logprobs,
            action_versions=self.versions,
            finish=_FINISH_OF_REASON[self.finish_reason],
            meta=meta,
            **rest,
        )

    @classmethod
    def from_trajectory(cls, traj: Trajectory) -> Completion:
        """Inverse of :meth:`to_trajectory` for a single-turn trajectory (prompt then actions)."""
        P = traj.prompt_length
        act = traj.action_mask.astype(bool)
        if not act[P:].all():
            raise ValueError(f"trajectory {traj.traj_id!r}: not single-turn (non-action tokens after the prompt)")
        for key in ("request_id", "sample_index", "finish_reason"):
            if key not in traj.meta:
                raise ValueError(f"trajectory {traj.traj_id!r}: meta lacks {key!r} (not made by to_trajectory)")
        sample_index = traj.meta["sample_index"]
        if sample_index is None:
            raise TypeError(f"trajectory {traj.traj_id!r}: meta sample_index is None")
        return cls(
            request_id=str(traj.meta["request_id"]),
            sample_index=int(sample_index),
            prompt_ids=[int(t) for t in traj.token_ids[:P]],
            token_ids=[int(t) for t in traj.token_ids[P:]],
            logprobs=[float(x) for x in traj.behavior_logprob[P:]],
            versions=[int(v) for v in traj.behavior_version[P:]],
            finish_reason=str(traj.meta["finish_reason"]),
            params=SamplingParams.from_record(traj.sampling) if traj.sampling else None,
            seed=traj.rng_seed,
        )
