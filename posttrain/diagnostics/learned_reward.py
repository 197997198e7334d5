"""How far a learned reward agrees with the verifier: the reward model's (or LLM judge's) component against
the verifier's statuses, read from a run's ledger.

A learned reward (``reward.model``, ``reward.judge``; posttrain/rewards/learned.py) sits beside the
verifier's components in each trajectory's ``reward_components``. Where the verifier says ``correct`` for
some responses of a prompt's group and otherwise for others, a learned reward that agrees with it scores
the correct ones higher. :func:`learned_agreement` reports, over the trajectories that carry the component
and a verdict (``correct``, ``wrong`` or ``invalid``):

- ``mean_correct`` / ``mean_other``: the component's mean over correct and over not-correct responses;
- ``pairwise_agreement``: over every (correct, not-correct) pair of responses **in the same group**, the
  share where the component ranks the correct one higher (a tie counts one half): 1 = the learned reward
  orders each group as the verifier does, 0.5 = no better than chance, below 0.5 = it prefers what the
  verifier fails (an over-optimised reward model, Gao et al. 2023, arXiv:2210.10760).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.trajectory import Status, Trajectory

_JUDGED = (Status.CORRECT, Status.WRONG, Status.INVALID)


@dataclasses.dataclass(frozen=True)
class LearnedAgreement:
    """Agreement of learned component ``component`` with the verifier (module docstring); ``None`` where
    there is nothing to average (no such response, no mixed group)."""

    component: str
    n: int
    mean_correct: float | None
    mean_other: float | None
    pairwise_agreement: float | None
    pairs: int

    def lines(self) -> list[str]:
        """Human-readable summary lines for ``posttrain report``."""
        def f(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f}"

        return [f"learned reward {self.component!r} vs verifier: {self.n} judged responses carry it; mean on "
                f"correct {f(self.mean_correct)}, on the others {f(self.mean_other)}",
                f"  ranks the verifier's correct response higher in {f(self.pairwise_agreement)} of {self.pairs} "
                "(correct, not-correct) pairs of the same group (0.5 = chance)"]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def learned_agreement(trajectories: Sequence[Trajectory], component: str) -> LearnedAgreement:
    """:class:`LearnedAgreement` of ``component`` over ``trajectories`` (module docstring)."""
    rows = [t for t in trajectories if t.status in _JUDGED and component in t.reward.components]
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for t in rows:
        good, other = groups.setdefault(t.group_id, ([], []))
        (good if t.status is Status.CORRECT else other).append(float(t.reward.components[component]))
    wins, pairs = 0.0, 0
    for good, other in groups.values():
        for g in good:
            for o in other:
                wins += 1.0 if g > o else 0.5 if g == o else 0.0
                pairs += 1
    return LearnedAgreement(
        component=component, n=len(rows),
        mean_correct=_mean([v for good, _ in groups.values() for v in good]),
        mean_other=_mean([v for _, other in groups.values() for v in other]),
        pairwise_agreement=wins / pairs if pairs else None, pairs=pairs)


def learned_component_names(config: Mapping[str, Any]) -> list[str]:
    """The learned components a run's ``config.yaml`` (as a dict) declares: ``reward.model.name`` and
    ``reward.judge.name`` (defaults ``rm`` and ``judge``), those that are set."""
    reward = config.get("reward") or {}
    defaults = {"model": "rm", "judge": "judge"}
    return [str((reward[key] or {}).get("name", default)) for key, default in defaults.items() if reward.get(key)]


def run_agreements(run_dir: str | Path, config: Mapping[str, Any]) -> list[LearnedAgreement]:
    """:func:`learned_agreement` of every learned component ``config`` declares
    (:func:`learned_component_names`) over every trajectory of ``run_dir``'s ledger; ``[]`` when it declares none."""
    from posttrain.diagnostics.load import open_ledger

    names = learned_component_names(config)
    if not names:
        return []
    trajectories = open_ledger(run_dir).read_trajectories()
    return [learned_agreement(trajectories, name) for name in names]
