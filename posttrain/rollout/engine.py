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
    - Greedy (``temperature == 0``): the behaviour distribution is the point mass on the argmax, so
      every sampled token's log-prob is exactly ``0.0`` (an engine whose sampler reports
      ``log_softmax(logits)`` there, like vLLM, maps it to 0; the learner's tempered recomputation
      is not a greedy policy, so greedy samples are for evaluation, not off-policy-corrected updates).

    Optional attribute ``reproducible_resume: bool`` (absent = ``False``): pause + resume with
    unchanged weights yields exactly the tokens of an uninterrupted run (true for the built-in
    engine; vLLM re-seeds a resumed request, so it only guarantees that a resume extends the
    paused tokens).

    Optional colocation hooks ``sleep()`` / ``wake()`` (absent = no-op; call them through
    :func:`engine_sleep` / :func:`engine_wake`): ``sleep`` releases the engine's weights and caches
    while the learner updates on the same devices; ``wake`` re-acquires the memory, and the next
    ``update_weights`` (which must carry every weight) refills it — the weights are discarded, not
    kept, as in vLLM's sleep level 2. ``sleep`` returns None when it released the memory, or a
    one-line reason when it cannot here (vLLM without CUDA): then nothing is released and ``wake``
    must not be called.
    """

    @property
    def version(self) -> int:
        """The weight version the engine samples with (set by ``update_weights``; read-only here, so an engine
        may keep it as a plain attribute or answer it from a server)."""
        ...

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


def engine_sleep(engine: object) -> str | None:
    """Release ``engine``'s memory for an update (its optional ``sleep()`` hook, see
    :class:`RolloutEngine`). Returns None when it slept, else why not (no hook, or the reason the
    hook gave) — the caller logs it; nothing is released then and no ``wake`` is due."""
    sleep = getattr(engine, "sleep", None)
    if sleep is None:
        return f"{type(engine).__name__} has no sleep() hook"
    reason = sleep()
    return None if reason is None else f"{type(engine).__name__}: {reason}"


def engine_wake(engine: object) -> None:
    """Re-acquire what :func:`engine_sleep` released (the engine's ``wake()``); follow it with a full
    ``update_weights`` before the next ``generate``."""
    engine.wake()  # type: ignore[attr-defined]


def eos_id_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The end-of-sequence ids as a set: ``None`` -> none, an int -> one, a list (HF configs allow it) -> all."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(e) for e in eos_token_id)


def validate_requests(
    requests: Sequence[GenerationRequest], *, vocab_size: int, context: int | None, has_tokenizer: bool
) -> None:
    """Reject a bad ``generate`` call before any compute, with a ``ValueError`` naming the request.

    Checks (shared by every engine): a non-empty list; unique ``(request_id, sample_index)``
    completion keys (a request id recurs only as resumes of distinct samples); a non-empty prompt of
    ids in ``[0, vocab_size)`` shorter than ``context``; :meth:`SamplingParams.validate`;
    ``stop_strings`` only with a tokenizer; a resume only of a ``"paused"`` completion of the same
    request and prompt that still leaves room in the context.
    """
    if len(requests) == 0:
        raise ValueError("generate: empty request list")
    seen: set[tuple[str, int]] = set()
    for r in requests:
        rid = r.request_id
        keys = {(rid, r.resume.sample_index)} if r.resume is not None else {(rid, i) for i in range(max(1, r.params.n))}
        if keys & seen:
            raise ValueError(f"request {rid!r}: duplicate request_id / sample in one generate call")
        seen |= keys
        if len(r.prompt_ids) == 0:
            raise ValueError(f"request {rid!r}: empty prompt")
        bad = [t for t in r.prompt_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"request {rid!r}: prompt token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if context is not None and len(r.prompt_ids) >= context:
            raise ValueError(
                f"request {rid!r}: prompt of {len(r.prompt_ids)} tokens leaves no room in the context of {context}"
            )
        r.params.validate(rid, vocab_size)
        if r.params.stop_strings and not has_tokenizer:
            raise ValueError(f"request {rid!r}: stop_strings need a tokenizer on the engine")
        if r.resume is not None:
            c = r.resume
            if c.finish_reason != "paused":
                raise ValueError(f"request {rid!r}: can only resume a paused completion, got {c.finish_reason!r}")
            if c.request_id != rid or list(c.prompt_ids) != list(r.prompt_ids):
                raise ValueError(f"request {rid!r}: resume completion belongs to request {c.request_id!r}/another prompt")
            if context is not None and len(r.prompt_ids) + len(c.token_ids) >= context:
                raise ValueError(f"request {rid!r}: resumed sequence fills the context of {context}")
