"""What a held-out evaluation reports beside accuracy: per-constraint-family rates and tool calls per episode.

- :func:`constraint_rates`: for instruction following (``instructions`` verifier), the fraction of
  each constraint family's constraints the responses met, from the ``ifc/<family>`` reward components
  the verifier returns (1.0 / 0.0 per constraint of the prompt; Tulu 3's per-constraint partial
  credit, Lambert et al. 2024, arXiv:2411.15124). A family counts only the responses to prompts that
  carry it, so the rates say which kinds of instruction the policy follows, not how often a kind is asked.
- :func:`tool_calls_per_episode`: for a tool environment (one that declares the ``tool_calls`` reward
  part and has its tools enabled), the mean of ``tool_calls`` over the held-out episodes; None for an
  environment without tools (or with them switched off: the ``heldout_notool`` evaluation).

Both count the samples the accuracy counts (infra errors and environment failures left out).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

CONSTRAINT_PREFIX = "ifc/"
"""Prefix of the reward components that are one constraint family each (``ifc/<family>``, see
:mod:`posttrain.rewards.instructions`); the metric keys keep it (``heldout_unseen/ifc/<family>``)."""

TOOL_CALLS = "tool_calls"
"""The reward part a tool environment reports, +1 per valid tool call (:mod:`posttrain.envs.tool_calling`)."""


def constraint_rates(components: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """``{"ifc/<family>": met / asked}`` over the judged responses' reward ``components``.

    Each mapping is one response's raw (unweighted) components; a component ``ifc/<family>`` is 1.0
    when that response met the family's constraint and 0.0 when not (an empty response: 0.0 for each).
    ``asked`` counts the responses whose prompt carried the family. Families no response was asked
    are absent; ``{}`` when no component has the prefix (every task but instruction following).
    Sorted by family name.
    """
    met: dict[str, float] = {}
    asked: dict[str, int] = {}
    for comps in components:
        for k, v in comps.items():
            if k.startswith(CONSTRAINT_PREFIX):
                met[k] = met.get(k, 0.0) + float(v)
                asked[k] = asked.get(k, 0) + 1
    return {k: met[k] / asked[k] for k in sorted(met)}


def has_tools(env: object) -> bool:
    """Whether ``env`` is a tool environment with its tools on: it declares the ``tool_calls`` reward part
    (``reward_components``) and is not switched to its no-tool baseline (``use_tools`` false)."""
    declared = getattr(env, "reward_components", None) or ()
    return TOOL_CALLS in declared and bool(getattr(env, "use_tools", True))


def tool_calls_per_episode(components: Sequence[Mapping[str, float]]) -> float:
    """Mean ``tool_calls`` component over the episodes' reward ``components`` (an episode that reported
    none called no tool: 0); NaN for no episode."""
    if not components:
        return float("nan")
    return sum(float(c.get(TOOL_CALLS, 0.0)) for c in components) / len(components)
