"""The engine protocol every rollout backend implements (built-in PyTorch, vLLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from posttrain.rollout.types import Completion, GenerationRequest


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions under a recorded behaviour distribution and takes live weight updates.

    Contract (checked by ``tests/rollout/test_engine_contract.py`` for every engine):

    - ``generate(requests)`` returns ``params.n`` completions per fresh request, one per resumed
      request, ordered by request then ``sample_index``; every token carries its exact behaviour
      log-prob and the ``version`` that sampled it.
    - ``finish_target=k``: once ``k`` completions have finished, the rest are returned with
      ``finish_reason="paused"``; ``pause()`` from another thread does the same at the next step.
      A paused completion resumes through ``GenerationRequest(resume=completion)``.
    - ``update_weights(state_dict, version)`` copies weights in place; ``version`` becomes the
      given one, or ``version + 1`` when ``None``.

    Optional attribute ``reproducible_resume: bool`` (absent = ``False``): pause + resume with
    unchanged weights yields exactly the tokens of an uninterrupted run (true for the built-in
    engine; vLLM re-seeds a resumed request, so it only guarantees that a resume extends the
    paused tokens).
    """

    version: int

    def generate(
        self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None
    ) -> list[Completion]:
        """Sample completions for ``requests`` (see the class docstring)."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Swap in new weights without reallocating; bump or set ``version``."""
        ...

    def pause(self) -> None:
        """Ask a running ``generate`` to stop at its next step and return unfinished samples as paused."""
        ...
