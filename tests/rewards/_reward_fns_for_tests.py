"""A user's reward-function module for the plug-in contract tests (imported by dotted path)."""

from __future__ import annotations

import math
from typing import Any

from posttrain.rewards import Verdict
from posttrain.trajectory import Status


def brevity(response: str, reference: Any, *, prompt: str, meta: dict) -> float:
    """1 / (1 + len(response)): shorter is better."""
    return 1.0 / (1.0 + len(response))


async def echoes_prompt(response: str, reference: Any, *, prompt: str, meta: dict) -> float:
    """Async: 1 if the prompt text appears in the response, else 0; meta['bonus'] added when given."""
    return float(prompt in response) + float(meta.get("bonus", 0.0))


def verdict_fn(response: str, reference: Any, *, prompt: str, meta: dict) -> Verdict:
    """A one-component Verdict: 2.0 when the response equals str(reference)."""
    return Verdict(Status.CORRECT, {"match": 2.0 if response == str(reference) else 0.0})


def infra_verdict(response: str, reference: Any, *, prompt: str, meta: dict) -> Verdict:
    return Verdict(Status.INFRA_ERROR, {})


def boom(response: str, reference: Any, *, prompt: str, meta: dict) -> float:
    raise RuntimeError("reward service down")


def nan(response: str, reference: Any, *, prompt: str, meta: dict) -> float:
    return math.nan


def text(response: str, reference: Any, *, prompt: str, meta: dict) -> Any:
    return "0.5"


def wrong_signature(response: str) -> float:
    return 0.0


NOT_A_FUNCTION = 3
