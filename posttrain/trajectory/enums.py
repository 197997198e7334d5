"""Closed vocabularies of the trajectory contract (see docs/architecture.md)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """Who produced a token. Only ``ACTION`` tokens ever carry ``action_mask = 1``."""

    PROMPT = "prompt"
    ACTION = "action"
    OBSERVATION = "observation"
    SYSTEM = "system"
    PADDING = "padding"


class Status(StrEnum):
    """The verifier's honest verdict on a trajectory.

    ``INFRA_ERROR`` (a crash of the verifier, its pool or the machine) is never a reward:
    such trajectories carry no total and are excluded from the update and counted.
    """

    CORRECT = "correct"
    WRONG = "wrong"
    INVALID = "invalid"
    TIMEOUT = "timeout"
    ENV_FAILURE = "env_failure"
    INFRA_ERROR = "infra_error"


class Finish(StrEnum):
    """How the sequence ended. Terminal and truncated stay distinct in value targets;
    paused is neither (the trajectory will resume)."""

    TERMINAL = "terminal"
    TRUNCATED = "truncated"
    PAUSED = "paused"


ROLE_CODES: dict[Role, int] = {r: i for i, r in enumerate(Role)}
CODE_ROLES: dict[int, Role] = {i: r for r, i in ROLE_CODES.items()}
