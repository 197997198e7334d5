"""Held-out evaluation: generate on held-out prompts, verify, and report accuracy by status.

Accuracy is the fraction of held-out prompts whose (greedy by default) response the task's
verifier marks ``correct``; infra errors are excluded from the denominator and counted
(``heldout/infra_errors``). Verification goes through the same guarded path as training
(``verify_batch``, a :class:`~posttrain.rewards.VerifierPool`): a verifier that raises, hangs or
returns garbage on a held-out sample is an infra error there too, never a crash or a freeze.
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

    @property
    def infra_errors(self) -> int:
        """Samples whose verification failed (excluded from the accuracy denominator)."""
        return int(self.status_counts.get(Status.INFRA_ERROR.value, 0))

    def as_metrics(self, prefix: str = "heldout") -> dict[str, float]:
        """Flat metric dict (``heldout/accuracy``, ``heldout/infra_errors`` ...)."""
        out = {f"{prefix}/accuracy": self.accuracy, f"{prefix}/reward_mean": self.reward_mean,
               f"{prefix}/mean_length": self.mean_length, f"{prefix}/infra_errors": float(self.infra_errors)}
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
    verify_batch: Any | None = None,
) -> EvalResult:
    """Evaluate the engine's current weights on ``examples`` (``TaskExample`` objects).

    ``verify_batch`` is the run's guarded verification (``VerifierPool.verify_batch`` or reward
    workers); None verifies in-process through a ``VerifierPool(workers=0)`` (default time limit).
    Never raises for a verifier's failure: such a sample is an ``infra_error``.
    """
    from posttrain.loop.scoring import decode_response
    from posttrain.rewards import VerifierPool
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
    if verify_batch is None:
        verify_batch = VerifierPool(workers=0).verify_batch
    texts = [decode_response(tokenizer, c) for c in comps]
    verdicts = verify_batch([(task.verifier, t, ex.reference, {}) for t, ex in zip(texts, examples, strict=True)])
    for c, v in zip(comps, verdicts, strict=True):
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
