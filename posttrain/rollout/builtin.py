"""The built-in PyTorch rollout engine: the embedded default on CPU, any HF causal LM.

Per call of :meth:`BuiltinEngine.generate`:

1. validate every request (a ``ValueError`` names the bad one before any compute);
2. group samples by prefix: a fresh request's ``n`` samples share one prefill of its prompt,
   whose cache rows are then repeated ``n`` times; a resumed sample prefills prompt + its tokens;
3. per batch (at most ``max_batch_size`` samples), left-padded prefill, then decode with a KV
   cache; at every step draw each row's token from its exact behaviour distribution
   (:mod:`posttrain.rollout.sampling`) and record ``log mu(token)`` and the engine version;
4. a row that finishes (eos, stop id or string, length) leaves the batch at once: the cache is
   compacted, so finished rows cost no further compute;
5. on ``pause()`` or once ``finish_target`` samples have finished, the unfinished rows are
   returned as ``"paused"``; a resumed sample continues the very random stream it was using
   (uniforms are keyed by ``(seed, sample_index, token index)``), so pause + resume with
   unchanged weights gives the tokens of an uninterrupted run.

``stats`` counts the work done (prefill rows and tokens, decode row-steps), so tests can check
that prompts are prefilled once and that finished rows are not computed.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from posttrain.rollout.engine import eos_id_set, validate_requests
from posttrain.rollout.runners import HFRunner, StaticCacheRunner, supports_fast_path
from posttrain.rollout.sampling import behaviour_logprobs, sample_tokens, uniforms
from posttrain.rollout.types import Completion, GenerationRequest

if TYPE_CHECKING:  # transformers is imported by whoever builds the model
    from transformers import PreTrainedTokenizerBase


@dataclasses.dataclass
class _Row:
    """One sample being generated (mutable during a call)."""

    req_index: int
    request: GenerationRequest
    sample_index: int
    seed: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    full: list[torch.Tensor]
    budget: int
    finish: str | None = None

    @property
    def prefix(self) -> tuple[int, ...]:
        return (*self.request.prompt_ids, *self.tokens)


class BuiltinEngine:
    """Batched, KV-cached, exactly-recorded sampling from a ``transformers`` causal LM.

    ``model``: any HF causal LM (Qwen2 and Llama models, SmolLM2 included, take the static-cache
    fast path unless ``fast_path=False``). ``tokenizer`` is needed only for ``stop_strings``. ``eos_token_id``
    defaults to the tokenizer's, else the model config's (an int or a list). ``max_batch_size``
    bounds the samples decoded together (``None``: all). ``version`` is the initial weight version.
    """

    #: pause + resume with unchanged weights reproduces the uninterrupted tokens exactly (the
    #: uniforms are keyed by (seed, sample_index, token index), see the module docstring).
    reproducible_resume: bool = True

    def __init__(
        self,
        model: Any,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int = 0,
        max_batch_size: int | None = None,
        version: int = 0,
        fast_path: bool = True,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
        self.eos_ids: frozenset[int] = eos_id_set(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        self.version = int(version)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.context: int | None = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.runner: HFRunner | StaticCacheRunner = (
            StaticCacheRunner(model) if fast_path and supports_fast_path(model) else HFRunner(model)
        )
        self.stats: dict[str, int] = {"prefill_rows": 0, "prefill_tokens": 0, "decode_row_steps": 0}
        self._pause = threading.Event()
        # generate and update_weights never interleave: a weight swap never lands mid-step.
        self._lock = threading.Lock()
        # sleep() / wake(): shapes of the released parameters; True until update_weights refills them.
        self._released: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        self._needs_weights = False

    # ------------------------------------------------------------------ control
    def pause(self) -> None:
        """Make the running ``generate`` return its unfinished samples as ``"paused"`` at its next step.

        A pause that arrives before ``generate`` has started is discarded (``generate`` clears it).
        """
        self._pause.set()

    def sleep(self) -> str | None:
        """Release the weight copy while the learner updates (colocation; ``system.engine_sleep``).

        Every parameter's storage is replaced by an empty tensor, so its memory is freed (the runners
        hold no tensors between calls: their KV caches live inside one ``generate``). Like vLLM's
        sleep level 2, the weights are discarded, not kept: the next weight sync brings new ones.
        Buffers (rotary tables) are kept. Until :meth:`wake` and an :meth:`update_weights` covering
        every parameter, :meth:`generate` raises. Waits for a running ``generate``; idempotent.
        Returns None (released; see :func:`~posttrain.rollout.engine.engine_sleep`).
        """
        with self._lock:
            for name, p in self.model.named_parameters():
                if name not in self._released:
                    self._released[name] = (p.shape, p.dtype, p.device)
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return None

    def wake(self) -> None:
        """Re-allocate the released parameters (uninitialised); the caller then loads the weights with
        :meth:`update_weights`, which must cover every parameter before ``generate`` runs again."""
        with self._lock:
            params = dict(self.model.named_parameters())
            for name, (shape, dtype, device) in self._released.items():
                params[name].data = torch.empty(shape, dtype=dtype, device=device)
            self._needs_weights = self._needs_weights or bool(self._released)
            self._released = {}

    @property
    def asleep(self) -> bool:
        """True between :meth:`sleep` and :meth:`wake`."""
        return bool(self._released)

    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """``param.copy_(state_dict[name])`` for every entry, in place (no reallocation).

        Names are those of ``model.named_parameters()`` / ``named_buffers()`` (tied weights
        under either name). Unknown names or shape mismatches raise ``ValueError`` before any
        copy. ``version`` becomes the given value, else ``version + 1``. Waits for a running
        ``generate`` to return (call :meth:`pause` first for a partial rollout).
        """
        if self._released:
            raise RuntimeError("update_weights: the engine is asleep (sleep() released its weights): wake() first")
        targets: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        for name, t in state_dict.items():
            if name not in targets:
                raise ValueError(f"update_weights: unknown tensor {name!r} (not a parameter or buffer of the model)")
            if tuple(t.shape) != tuple(targets[name].shape):
                raise ValueError(
                    f"update_weights: tensor {name!r} has shape {tuple(t.shape)}, model has {tuple(targets[name].shape)}"
                )
        with self._lock:
            if self._released:
                raise RuntimeError("update_weights: the engine is asleep (sleep() released its weights): wake() first")
            if self._needs_weights:  # after wake(): every parameter must be refilled, ties under either name
                covered = {targets[n].data_ptr() for n in state_dict}
                left = [n for n, p in self.model.named_parameters() if p.data_ptr() not in covered]
                if left:
                    raise ValueError(f"update_weights after wake() must load every parameter; missing {left[:3]}")
            for name, t in state_dict.items():
                targets[name].copy_(t)
            self._needs_weights = False
            self.version = self.version + 1 if version is None else int(version)

    # ------------------------------------------------------------------ validation
    def _validate(self, requests: Sequence[GenerationRequest]) -> None:
        validate_requests(requests, vocab_size=self.vocab_size, context=self.context,
                          has_tokenizer=self.tokenizer is not None)

    def _rows(self, requests: Sequence[GenerationRequest]) -> list[_Row]:
        rows: list[_Row] = []
        for qi, r in enumerate(requests):
            limit = r.params.max_new_tokens
            if self.context is not None:
                limit = min(limit, self.context - len(r.prompt_ids))
            if r.resume is not None:
                c = r.resume
                seed = c.seed if c.seed is not None else (r.params.seed if r.params.seed is not None else 0)
                full = [] if c.full_logprobs is None else list(c.full_logprobs.unbind(0))
                rows.append(
                    _Row(qi, r, c.sample_index, int(seed), list(c.token_ids), list(c.logprobs), list(c.versions), full, limit)
                )
                continue
            # No seed: draw one from torch's global generator (so torch.manual_seed reproduces it) and record it.
            seed = r.params.seed if r.params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            for i in range(r.params.n):
                rows.append(_Row(qi, r, i, int(seed), [], [], [], [], limit))
        return rows

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None) -> list[Completion]:
        """``params.n`` completions per fresh request (one per resumed), ordered by request then sample index.

        See the module docstring for the algorithm and :class:`~posttrain.rollout.engine.RolloutEngine`
        for the contract. ``finish_target``: stop once that many samples have finished in this
        call and return the rest as ``"paused"``.
        """
        self._validate(requests)
        if finish_target is not None and finish_target < 1:
            raise ValueError(f"finish_target must be >= 1, got {finish_target}")
        with self._lock:
            if self._released or self._needs_weights:
                raise RuntimeError("generate: the engine released its weights (sleep); wake() and update_weights first")
            self._pause.clear()
            rows = self._rows(requests)
            for row in rows:
                if len(row.tokens) >= row.budget:
                    row.finish = "length"
            counter = [sum(1 for r in rows if r.finish is not None)]
            for batch in self._batches([r for r in rows if r.finish is None]):
                if self._stop_now(counter[0], finish_target):
                    break
                self._run_batch(batch, counter, finish_target)
            self._pause.clear()
        rows.sort(key=lambda r: (r.req_index, r.sample_index))
        return [self._completion(r) for r in rows]

    def _stop_now(self, finished: int, target: int | None) -> bool:
        return self._pause.is_set() or (target is not None and finished >= target)

    def _batches(self, rows: list[_Row]) -> list[list[_Row]]:
        cap = self.max_batch_size or max(1, len(rows))
        return [rows[i : i + cap] for i in range(0, len(rows), cap)]

    def _run_batch(self, rows: list[_Row], counter: list[int], target: int | None) -> None:
        dev = self.device
        # Unique prefixes: the n samples of a fresh request share one prefill.
        prefixes: dict[tuple[int, ...], int] = {}
        unit_of_row = [prefixes.setdefault(r.prefix, len(prefixes)) for r in rows]
        plist = list(prefixes)
        T = max(len(p) for p in plist)
        ids = torch.full((len(plist), T), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(plist), T), dtype=torch.long)
        for unit, p in enumerate(plist):
            ids[unit, T - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[unit, T - len(p) :] = 1
        capacity = T + max(r.budget - len(r.tokens) for r in rows)
        logits, session = self.runner.prefill(ids.to(dev), mask.to(dev), capacity)
        self.stats["prefill_rows"] += len(plist)
        self.stats["prefill_tokens"] += int(mask.sum())
        idx = torch.tensor(unit_of_row, dtype=torch.long, device=dev)
        if len(plist) != len(rows) or unit_of_row != list(range(len(rows))):
            session.select(idx)
            logits = logits.index_select(0, idx)

        active = list(rows)

        def params_of(rs: list[_Row]) -> tuple[torch.Tensor, ...]:
            ps = [r.request.params for r in rs]
            return (
                torch.tensor([p.temperature for p in ps], dtype=torch.float64, device=dev),
                torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev),
                torch.tensor([p.top_p for p in ps], dtype=torch.float64, device=dev),
                torch.tensor([p.min_p for p in ps], dtype=torch.float64, device=dev),
            )

        temp, topk, topp, minp = params_of(active)
        seeds = [r.seed for r in active]
        samples = [r.sample_index for r in active]
        while active:
            if self._stop_now(counter[0], target):
                return
            logp = behaviour_logprobs(logits, temp, topk, topp, minp)
            u = uniforms(seeds, samples, [len(r.tokens) for r in active]).to(dev)
            tok = sample_tokens(logp, u)
            lp = logp.gather(1, tok[:, None]).squeeze(1)
            toks, lps = tok.tolist(), lp.tolist()
            keep: list[int] = []
            for i, r in enumerate(active):
                t = toks[i]
                r.tokens.append(t)
                r.logprobs.append(float(lps[i]))
                r.versions.append(self.version)
                if r.request.params.return_full_logprobs:
                    r.full.append(logp[i].clone())
                r.finish = self._finish_of(r, t)
                if r.finish is None:
                    keep.append(i)
                else:
                    counter[0] += 1
            if not keep:
                return
            if len(keep) < len(active):
                kidx = torch.tensor(keep, dtype=torch.long, device=dev)
                session.select(kidx)
                tok = tok.index_select(0, kidx)
                temp, topk, topp, minp = (x.index_select(0, kidx) for x in (temp, topk, topp, minp))
                active = [active[i] for i in keep]
                seeds = [seeds[i] for i in keep]
                samples = [samples[i] for i in keep]
            if self._stop_now(counter[0], target):
                return
            logits = session.decode(tok)
            self.stats["decode_row_steps"] += len(active)

    def _finish_of(self, r: _Row, t: int) -> str | None:
        p = r.request.params
        if t in self.eos_ids:
            return "eos"
        if t in p.stop_token_ids:
            return "stop"
        if p.stop_strings and self.tokenizer is not None:  # validate_requests refused stop strings without one
            text = self.tokenizer.decode(r.tokens)
            if any(s in text for s in p.stop_strings):
                return "stop"
        if len(r.tokens) >= r.budget:
            return "length"
        return None

    def _completion(self, r: _Row) -> Completion:
        full = None
        if r.request.params.return_full_logprobs:
            V = self.vocab_size
            full = torch.stack(r.full).cpu() if r.full else torch.empty(0, V, dtype=torch.float64)
        return Completion(
            request_id=r.request.request_id,
            sample_index=r.sample_index,
            prompt_ids=list(r.request.prompt_ids),
            token_ids=r.tokens,
            logprobs=r.logprobs,
            versions=r.versions,
            finish_reason=r.finish or "paused",
            full_logprobs=full,
            params=r.request.params,
            seed=r.seed,
        )
