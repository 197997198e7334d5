"""Plug-in tasks for the fault tests (no tests here): verifiers that fail in every way a verifier can."""

from __future__ import annotations

import dataclasses

from posttrain.envs.chain_sum import ChainSumTask
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.verdict import Verdict


def failure_kind(reference: object) -> str | None:
    """Which failure the tricky verifier shows for a reference (by its value mod 5)."""
    return {0: "loop", 1: "raise", 2: "nan", 3: "gold"}.get(int(reference) % 5)  # type: ignore[call-overload]


class TrickyVerifier:
    """Integer verifier that, by reference, loops forever in pure Python, raises, returns NaN
    instead of a Verdict, or cannot parse the gold answer."""

    name = "tricky"
    version = "1"

    def verify(self, response: str, reference: object, **context: object) -> Verdict:
        kind = failure_kind(reference)
        if kind == "loop":
            while True:  # a pure-Python hang: no signal, no I/O
                pass
        if kind == "raise":
            raise RuntimeError("verifier backend unavailable")
        if kind == "nan":
            return float("nan")  # type: ignore[return-value]
        if kind == "gold":
            raise ValueError(f"cannot parse gold answer {reference!r}")
        return IntegerVerifier().verify(response, reference, **context)


def tricky(**kwargs: object) -> ChainSumTask:
    """chain_sum with :class:`TrickyVerifier`."""
    return dataclasses.replace(ChainSumTask(**kwargs), verifier=TrickyVerifier())  # type: ignore[arg-type]
