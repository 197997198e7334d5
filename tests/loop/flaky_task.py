"""A user-style plug-in task for the loop tests: chain sums whose verifier crashes on some inputs."""

from __future__ import annotations

import dataclasses
import os
import time

from posttrain.envs.chain_sum import ChainSumTask
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.verdict import Verdict


class CrashingVerifier:
    """Raises (an infrastructure failure, not a wrong answer) when the response contains a '7'."""

    name = "crashy"
    version = "1"

    def verify(self, response: str, reference: object, **context: object) -> Verdict:
        if "7" in response:
            raise RuntimeError("verifier backend unavailable")
        return IntegerVerifier().verify(response, reference, **context)


def flaky(**kwargs: object) -> ChainSumTask:
    """chain_sum with the crashing verifier."""
    return dataclasses.replace(ChainSumTask(**kwargs), verifier=CrashingVerifier())  # type: ignore[arg-type]


class HangingVerifier:
    """Integer verifier that hangs (a stuck verification worker) once ``hang_when`` exists."""

    name = "integer"
    version = "1"

    def __init__(self, hang_when: str | None) -> None:
        self.hang_when = hang_when

    def verify(self, response: str, reference: object, **context: object) -> Verdict:
        if self.hang_when is not None and os.path.exists(self.hang_when):
            time.sleep(600)
        return IntegerVerifier().verify(response, reference, **context)


def hanging(hang_when: str | None = None, **kwargs: object) -> ChainSumTask:
    """chain_sum whose verifier hangs once the file ``hang_when`` exists."""
    return dataclasses.replace(ChainSumTask(**kwargs), verifier=HangingVerifier(hang_when))  # type: ignore[arg-type]


class StartsWithDigitVerifier:
    """Reward 1 when the response starts with a digit: learnable from a random init in a few steps."""

    name = "starts_with_digit"
    version = "1"

    def verify(self, response: str, reference: object, **context: object) -> Verdict:
        from posttrain.trajectory import Status

        ok = response[:1].isdigit()
        return Verdict(status=Status.CORRECT if ok else Status.WRONG, components={"task": float(ok)},
                       explanation=f"first char {response[:1]!r}")


def digit_first(**kwargs: object) -> ChainSumTask:
    """chain_sum prompts, rewarded for any answer that starts with a digit."""
    return dataclasses.replace(ChainSumTask(**kwargs), verifier=StartsWithDigitVerifier())  # type: ignore[arg-type]
