"""Held-out evaluation: generate on held-out prompts, verify, and report accuracy by status.

Accuracy is the fraction of held-out prompts whose (greedy by default) response the task's
verifier marks ``correct``; infra errors are excluded from the denominator and counted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

from posttrain.trajectory import Status


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Held-out figures of one policy revision."""

    accuracy: float
    reward_mean: float
    mean_length: float
    status_counts: dict[str, int]
    n: int

    def as_metrics(self, prefix: str = "heldout") -> dict[str, float]:
        """Flat metric dict (``heldout/accuracy`` ...)."""
        out = {f"{prefix}/accuracy": self.accuracy, f"{prefix}/reward_mean": self.reward_mean,
               f"{prefix}/mean_length": self.mean_length}
        out.update({f"{prefix}/status/{k}": float(v) for k, v in self.status_counts.items()})
        return out


def evaluate(
    engine: Any,
    tokenizer: Any,
    task: Any,
    examples: Sequence[Any],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> EvalResult:
    """Evaluate the engine's current weights on ``examples`` (``TaskExample`` objects)."""
    from posttrain.loop.scoring import decode_response
    from posttrain.rollout.sampling import SamplingParams
    from posttrain.rollout.types import GenerationRequest

    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=1, seed=seed)
    reqs = [
        GenerationRequest(request_id=f"eval{i}-{ex.prompt_id}", prompt_ids=tokenizer(ex.prompt).input_ids, params=params)
        for i, ex in enumerate(examples)
    ]
    comps = engine.generate(reqs)
    statuses: Counter[str] = Counter()
    rewards: list[float] = []
    lengths: list[int] = []
    for ex, c in zip(examples, comps, strict=True):
        text = decode_response(tokenizer, c)
        v = task.verifier.verify(text, ex.reference)
        statuses[v.status.value] += 1
        lengths.append(len(c.token_ids))
        if v.status is not Status.INFRA_ERROR:
            rewards.append(float(v.components.get("task", 0.0)))
    valid = sum(n for s, n in statuses.items() if s != Status.INFRA_ERROR.value)
    return EvalResult(
        accuracy=statuses[Status.CORRECT.value] / valid if valid else float("nan"),
        reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
        mean_length=sum(lengths) / len(lengths) if lengths else 0.0,
        status_counts=dict(statuses),
        n=len(examples),
    )
