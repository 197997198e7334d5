"""A bring-your-own reward function (docs/tasks_and_verifiers.md, "Bring your own: a complete example")."""

from typing import Any


def within_budget(response: str, reference: Any, *, prompt: str, meta: dict) -> float:
    """1.0 when the response has at most ``meta["max_chars"]`` characters (a column of data.jsonl), else 0.0."""
    return float(len(response.strip()) <= int(meta["max_chars"]))
