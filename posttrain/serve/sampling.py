"""Sampling for the Tinker API on posttrain's built-in engine (:class:`~posttrain.rollout.builtin.BuiltinEngine`):
exact per-token log-probs of what was sampled, and ``prompt_logprobs`` (how the SDK's
``compute_logprobs`` works) from :func:`~posttrain.learner.logprobs.token_logprobs`.

The engine runs a plain copy of the base model (its output embedding untied, so that an adapter on
the unembedding can be represented); before a batch, the weights of the batch's sampler are
loaded into it unless they are there already. Requests of one sampler that wait together run as
one ``generate`` call.

The SDK's ``SamplingParams`` map onto :class:`~posttrain.rollout.sampling.SamplingParams`:
``max_tokens`` -> ``max_new_tokens`` (default: the rest of the context), ``top_k = -1`` -> 0 (off),
``stop`` strings or token ids; the engine always stops at EOS, so ``stop=[]`` (which asks to
disable EOS) is refused, as are top-k log-probs, target prompt log-probs and alternative prompt tokens.
The context holds: ``len(prompt) + max_tokens <= max_context_length`` (also for ``compute_logprobs``, a
one-token sample with prompt log-probs), and prompt ids must lie in the vocabulary.

Log-probs of sampled tokens are those of the distribution the token was drawn from: at temperature
``T`` (and with top-k / top-p truncation) ``log softmax(z / T)`` renormalised over the kept set,
**not** the ``T = 1`` log-probs that ``compute_logprobs`` and ``forward_backward`` return. On-policy at
``T != 1`` the ratio ``exp(lp - q)`` of the ``importance_sampling`` / ``ppo`` losses is therefore not 1.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from transformers import PretrainedConfig

from posttrain.errors import UserError
from posttrain.learner.logprobs import token_logprobs
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest
from posttrain.serve.wire import SequenceOut


@dataclasses.dataclass(frozen=True)
class SampleCall:
    """One ``/asample`` request, validated: prompt tokens, engine parameters, and whether (and for how
    many last tokens; ``None`` = all) to return prompt log-probs."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    prompt_logprobs: bool
    prompt_logprobs_last_n: int | None = None


_REFUSED = {"topk_prompt_logprobs": 0, "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0,
            "target_prompt_logprobs": None, "record_stability_info": None}


def _route(body: Mapping[str, object]) -> str:
    """How the request names itself: the SDK's ``compute_logprobs`` is a one-token sample with prompt log-probs."""
    sp = body.get("sampling_params")
    one = isinstance(sp, Mapping) and sp.get("max_tokens") == 1 and body.get("num_samples", 1) == 1
    return "compute_logprobs" if body.get("prompt_logprobs") and one else "sample"


def sample_call(request_id: str, body: Mapping[str, object], prompt: list[int], context: int | None,
                vocab_size: int | None = None) -> SampleCall:
    """Validate a ``SampleRequest`` body (JSON) into a :class:`SampleCall`; ``UserError`` names what is
    unsupported, and a prompt that does not fit: ``len(prompt) + max_tokens <= context``, ids in ``[0, vocab_size)``."""
    route = _route(body)
    for key, neutral in _REFUSED.items():
        if body.get(key) not in (neutral, None, False, 0):
            raise UserError(f"{route}: {key} is not supported by posttrain serve")
    sp = body.get("sampling_params")
    if not isinstance(sp, Mapping):
        raise UserError(f"{route}: sampling_params missing")
    if not prompt:
        raise UserError(f"{route}: empty prompt")
    if vocab_size is not None:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"{route}: prompt token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    stop = sp.get("stop")
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    if isinstance(stop, str):
        stop_strings = (stop,)
    elif isinstance(stop, list):
        if not stop:
            raise UserError(f"{route}: stop=[] (disable EOS) is not supported: the engine always stops at EOS")
        if all(isinstance(s, str) for s in stop):
            stop_strings = tuple(str(s) for s in stop)
        elif all(isinstance(s, int) for s in stop):
            stop_ids = tuple(int(s) for s in stop)
        else:
            raise UserError(f"{route}: stop must be strings or token ids, got {stop!r}")
    max_tokens = sp.get("max_tokens")
    if max_tokens is None:
        if context is None:
            raise UserError(f"{route}: max_tokens is required (the model has no context length)")
        max_tokens = context - len(prompt)
        if max_tokens < 1:
            raise UserError(f"{route}: a prompt of {len(prompt)} tokens leaves no room in the model's context "
                            f"of {context} tokens (max_context_length)")
    elif context is not None and len(prompt) + int(max_tokens) > context:
        raise UserError(f"{route}: prompt of {len(prompt)} tokens + max_tokens {max_tokens} exceeds the model's "
                        f"context of {context} tokens (max_context_length)")
    top_k = int(sp.get("top_k", -1))
    seed = sp.get("seed")
    params = SamplingParams(
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=0 if top_k == -1 else top_k,
        max_new_tokens=int(max_tokens),
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        n=int(body.get("num_samples", 1)),  # type: ignore[call-overload]
        seed=None if seed is None else int(seed),
    )
    try:
        params.validate(request_id)
    except ValueError as e:
        raise UserError(f"{route}: {e}") from None
    last_n = body.get("prompt_logprobs_last_n")
    want_prompt = bool(body.get("prompt_logprobs"))
    if last_n is not None and not (want_prompt and 1 <= int(last_n) <= len(prompt) - 1):  # type: ignore[call-overload]
        raise UserError(f"{route}: prompt_logprobs_last_n={last_n} needs prompt_logprobs and 1 <= n <= len(prompt) - 1")
    return SampleCall(request_id, prompt, params, want_prompt, None if last_n is None else int(last_n))  # type: ignore[call-overload]


@dataclasses.dataclass(frozen=True)
class SampleResult:
    """The sequences of one call and its prompt log-probs (NaN where none: position 0, or before the last n)."""

    sequences: list[SequenceOut]
    prompt_logprobs: list[float] | None


class Sampler:
    """The engine and the key of the weights loaded into it."""

    def __init__(self, base: torch.nn.Module, tokenizer: object | None) -> None:
        model = copy.deepcopy(base).eval()
        emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
        if emb_out is not None and emb_out.weight is emb_in.weight:  # untie: an unembedding adapter differs from the input embedding
            emb_out.weight = torch.nn.Parameter(emb_in.weight.detach().clone(), requires_grad=False)
            cfg: object = model.config
            if isinstance(cfg, PretrainedConfig):  # save_pretrained then writes both matrices
                cfg.tie_word_embeddings = False
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.engine = BuiltinEngine(model, tokenizer)  # type: ignore[arg-type]
        self.context: int | None = self.engine.context
        self.loaded: str | None = "base"

    def load(self, key: str, weights: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """Make the engine hold the weights named ``key`` (``weights()`` is called only when they are not loaded)."""
        if key != self.loaded:
            state = weights()  # a tied base's state dict names the unembedding too, so the untied copy gets it
            self.loaded = None
            self.engine.update_weights(state)
            self.loaded = key

    def run(self, calls: Sequence[SampleCall]) -> list[SampleResult]:
        """Sample every call (one engine call for all) and compute the prompt log-probs asked for."""
        comps = self.engine.generate([GenerationRequest(c.request_id, c.prompt, c.params) for c in calls])
        by_req: dict[str, list[SequenceOut]] = {c.request_id: [] for c in calls}
        for comp in comps:
            by_req[comp.request_id].append(SequenceOut(comp.token_ids, comp.logprobs, comp.finish_reason != "length"))
        results = []
        for c in calls:
            plp: list[float] | None = None
            if c.prompt_logprobs:
                ids = torch.tensor([c.prompt])
                lp, _ = token_logprobs(self.model, ids, torch.ones_like(ids))
                plp = [math.nan] + [float(x) for x in lp[0, 1:]]
                if c.prompt_logprobs_last_n is not None:
                    cut = len(plp) - c.prompt_logprobs_last_n
                    plp = [math.nan] * cut + plp[cut:]
            results.append(SampleResult(by_req[c.request_id], plp))
        return results
