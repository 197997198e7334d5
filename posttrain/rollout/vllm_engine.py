"""vLLM adapter behind the :class:`~posttrain.rollout.engine.RolloutEngine` protocol.

Users select it with ``rollout.engine=vllm``; vLLM then runs in its own environment (``make
vllm-env``; CPU or CUDA build) as a 127.0.0.1 server started by the trainer with
:func:`build_vllm_engine` as its factory (docs/rollout.md). Nothing here imports vLLM at module load: the translation
functions below work on plain attributes (duck types), so they are unit-tested on CPU with
recorded shapes (``tests/rollout/test_vllm_translation.py``); only :class:`VLLMEngine` needs vLLM.

How the contract maps onto vLLM (API names as of vLLM 0.10-0.11, V1 engine):

- **behaviour log-probs**: the engine is built with ``logprobs_mode="processed_logprobs"`` (an
  engine argument of ``vllm.LLM``), so the log-probs vLLM returns are those of the distribution
  it sampled from (after temperature and its logits processors) rather than of the raw logits;
  each request asks ``SamplingParams(logprobs=1)``, whose per-position dict
  ``{token_id: Logprob(logprob, rank, decoded_token)}`` always contains the sampled token.
  Whether top-k / top-p renormalisation is part of "processed" depends on the vLLM version:
  ``posttrain check`` (its ``behavior_vs_old`` check) measures it on your setup.
- **n samples**: one vLLM request per sample (``n=1``) with a per-sample seed derived from the
  request seed (:func:`sample_seed`); vLLM's prefix cache shares the prompt's KV blocks, and one
  request <-> one :class:`Completion` keeps the translation simple.
- **finish reasons**: ``CompletionOutput.finish_reason`` ``"length"`` -> length; ``"stop"`` with
  ``stop_reason`` ``None`` (end of sequence) or an eos id -> eos, another int (a stop token) or a str
  (a stop string) -> stop; ``"abort"`` or unfinished -> paused.
- **pause / finish_target**: requests are fed to ``llm.llm_engine`` (``add_request``) and
  stepped (``step()``, cumulative outputs); on ``pause()`` or once ``finish_target`` samples have
  finished the rest are aborted (``abort_request``) and returned ``"paused"`` with the tokens they
  had. A resume re-submits prompt + tokens so far with the remaining budget and a seed derived
  from ``(seed, sample_index, tokens so far)``: vLLM cannot continue the exact random stream, so
  ``reproducible_resume = False`` (a resume extends the paused tokens; it does not reproduce the
  uninterrupted run).
- **update_weights**: ``llm.collective_rpc(fn, args=(items,))`` runs ``fn(worker, items)`` on
  every worker, which calls ``worker.model_runner.reload_weights(weights_iterator=...)`` (or
  ``model.load_weights`` on older versions; vLLM models accept Hugging Face parameter names); then ``llm.reset_prefix_cache()`` so no KV block computed
  with the old weights is reused. With the multiprocessing executor a callable needs
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set by the constructor when unset).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from posttrain.rollout.engine import eos_id_set, validate_requests
from posttrain.rollout.sampling import SamplingParams, _splitmix64
from posttrain.rollout.types import Completion, GenerationRequest

INSTALL_HINT = "the vLLM engine needs vllm: build its environment with `make vllm-env` (docs/rollout.md)"


def require_vllm() -> ModuleType:
    """Import and return the ``vllm`` module, or raise ``ImportError`` with the install command."""
    try:
        return importlib.import_module("vllm")
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(INSTALL_HINT) from e


# ---------------------------------------------------------------------------------------------- translation
def sample_seed(seed: int, sample_index: int, start: int) -> int:
    """The vLLM seed of sample ``sample_index`` of a request, (re)started after ``start`` tokens.

    ``splitmix64(splitmix64(splitmix64(seed) ^ sample_index) ^ start) mod 2**31`` (SplitMix64,
    Steele et al. 2014): distinct samples get independent streams, and a resumed sample a new but
    deterministic one. Kept below ``2**31`` so every vLLM version's seed field accepts it.
    """
    h = _splitmix64(
        _splitmix64(_splitmix64(np.array([seed], dtype=np.uint64)) ^ np.uint64(sample_index)) ^ np.uint64(start)
    )
    return int(h[0] % np.uint64(2**31))


def to_vllm_sampling_kwargs(params: SamplingParams, *, seed: int, done_tokens: int = 0) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for ONE sample of ``params``.

    ``n=1`` (samples are separate requests); ``max_tokens = max_new_tokens - done_tokens`` (the
    budget left for a resumed sample); ``top_k = -1`` when ours is ``0`` (off; vLLM's historic
    "all tokens" value); ``temperature = 0`` stays greedy; ``logprobs=1`` returns the sampled
    token's log-prob; ``include_stop_str_in_output=True`` because our contract keeps the stopping
    token; ``detokenize`` only when stop strings need text. ``seed`` from :func:`sample_seed`.
    """
    left = params.max_new_tokens - done_tokens
    if left <= 0:
        raise ValueError(f"no token budget left ({done_tokens} of max_new_tokens={params.max_new_tokens} done)")
    return dict(
        n=1,
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=int(params.top_k) if params.top_k > 0 else -1,
        min_p=float(params.min_p),
        max_tokens=int(left),
        stop_token_ids=[int(t) for t in params.stop_token_ids],
        stop=list(params.stop_strings),
        seed=int(seed),
        logprobs=1,
        include_stop_str_in_output=True,
        detokenize=bool(params.stop_strings),
    )


def finish_reason_of(finish_reason: str | None, stop_reason: int | str | None, eos_ids: frozenset[int]) -> str:
    """Our finish reason from vLLM's ``CompletionOutput.finish_reason`` / ``stop_reason``.

    ``None`` (still running) or ``"abort"`` -> ``"paused"``; ``"length"`` -> ``"length"``;
    ``"stop"``: ``stop_reason is None`` (vLLM's end of sequence) or an eos id -> ``"eos"``, any
    other int (a stop token id) or a str (a stop string) -> ``"stop"``. Anything else raises.
    """
    if finish_reason is None or finish_reason == "abort":
        return "paused"
    if finish_reason == "length":
        return "length"
    if finish_reason == "stop":
        if stop_reason is None or (isinstance(stop_reason, int) and stop_reason in eos_ids):
            return "eos"
        return "stop"
    raise ValueError(f"unknown vLLM finish_reason {finish_reason!r}")


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None) -> list[float]:
    """``logprobs[i][token_ids[i]]`` per position; entries are ``Logprob`` objects (``.logprob``) or floats.

    vLLM returns, per generated position, a dict ``{token_id: Logprob}`` holding the top
    ``logprobs`` tokens **and** the sampled one. A missing list or entry raises ``ValueError``
    (the engine was not asked for log-probs, so the behaviour distribution is unknown).
    """
    if logprobs is None:
        raise ValueError("vLLM output has no logprobs (SamplingParams.logprobs was not set)")
    if len(logprobs) < len(token_ids):
        raise ValueError(f"vLLM output has {len(logprobs)} log-prob entries for {len(token_ids)} tokens")
    out: list[float] = []
    for i, t in enumerate(token_ids):
        d = logprobs[i]
        if d is None or int(t) not in d:
            raise ValueError(f"vLLM output lacks the sampled token {t}'s log-prob at position {i}")
        e = d[int(t)]
        out.append(float(getattr(e, "logprob", e)))
    return out


def completion_from_output(
    output: Any,
    *,
    request: GenerationRequest,
    sample_index: int,
    seed: int,
    version: int,
    eos_ids: frozenset[int],
    finished: bool | None = None,
) -> Completion:
    """One :class:`Completion` from a vLLM ``CompletionOutput``-like object (one sample, cumulative).

    Reads ``output.token_ids``, ``output.logprobs``, ``output.finish_reason``, ``output.stop_reason``.
    At temperature 0 every log-prob is 0.0 (the protocol's greedy definition, see
    :class:`~posttrain.rollout.engine.RolloutEngine`). For a resumed request (``request.resume`` set) the new tokens extend the paused completion's
    tokens, log-probs and versions; the new tokens get ``version``. ``finished=False`` forces
    ``"paused"`` (an aborted or still-running request).
    """
    new = [int(t) for t in output.token_ids]
    lps = sampled_logprobs(new, output.logprobs)
    if request.params.temperature == 0:
        # Greedy: the behaviour distribution is the point mass on the argmax, so log mu = 0 (the
        # protocol's one definition). vLLM reports log_softmax(logits) of the argmax here instead.
        lps = [0.0] * len(new)
    reason = finish_reason_of(output.finish_reason, getattr(output, "stop_reason", None), eos_ids)
    if finished is False:
        reason = "paused"
    prior = request.resume
    return Completion(
        request_id=request.request_id,
        sample_index=sample_index,
        prompt_ids=list(request.prompt_ids),
        token_ids=(list(prior.token_ids) if prior else []) + new,
        logprobs=(list(prior.logprobs) if prior else []) + lps,
        versions=(list(prior.versions) if prior else []) + [int(version)] * len(new),
        finish_reason=reason,
        params=request.params,
        seed=seed,
    )


def _load_weights_on_worker(worker: Any, items: list[tuple[str, torch.Tensor]]) -> None:
    """Run inside a vLLM worker (``collective_rpc``): load HF-named tensors into its model.

    ``model_runner.reload_weights`` (vLLM >= 0.2x) restores the checkpoint-format parameters,
    loads, and re-runs the post-load processing: on the CPU build linear weights are repacked for
    oneDNN and the plain parameters dropped, so a bare ``model.load_weights`` would have nothing to
    copy into. Older versions have only ``load_weights``.
    """
    runner = worker.model_runner
    if hasattr(runner, "reload_weights"):
        runner.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
    else:
        runner.model.load_weights(weights=items)


# ---------------------------------------------------------------------------------------------- engine
class VLLMEngine:
    """The rollout protocol over a ``vllm.LLM`` (see the module docstring for the mapping).

    ``model``: a path or hub-cache name for ``vllm.LLM`` (ignored when ``llm`` is given);
    ``llm_kwargs`` go to ``vllm.LLM`` (``logprobs_mode="processed_logprobs"`` and
    ``skip_tokenizer_init`` when no stop strings are needed are set unless given). ``llm``: an
    existing ``LLM``-like object (used by tests with fakes). ``eos_token_id`` defaults to the HF
    config's. ``vocab_size`` / ``context`` default to vLLM's model config. ``sampling_params_cls``
    defaults to ``vllm.SamplingParams`` (tests pass a recorder).
    """

    reproducible_resume: bool = False

    def __init__(
        self,
        model: str | None = None,
        *,
        llm: Any = None,
        eos_token_id: int | Sequence[int] | None = None,
        version: int = 0,
        vocab_size: int | None = None,
        context: int | None = None,
        has_tokenizer: bool | None = None,
        sampling_params_cls: Any = None,
        sleep_mode: bool | None = None,
        **llm_kwargs: Any,
    ) -> None:
        # sleep()/wake() need an LLM built with enable_sleep_mode=True (vLLM: CUDA only)
        self.sleep_mode = bool(llm_kwargs.get("enable_sleep_mode", False) if sleep_mode is None else sleep_mode)
        if llm is None:
            vllm = require_vllm()
            if model is None:
                raise ValueError("VLLMEngine needs a model path (or an llm object)")
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # our own callable for collective_rpc
            llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
            llm_kwargs.setdefault("skip_tokenizer_init", True)
            llm = vllm.LLM(model=model, **llm_kwargs)
        self.llm = llm
        mc = getattr(getattr(llm, "llm_engine", None), "model_config", None)
        hf = getattr(mc, "hf_config", None)
        if eos_token_id is None:
            eos_token_id = getattr(hf, "eos_token_id", None)
        self.eos_ids: frozenset[int] = eos_id_set(eos_token_id)
        if vocab_size is None:
            if mc is None:
                raise ValueError("VLLMEngine: vocab_size unknown (no llm.llm_engine.model_config); pass vocab_size=")
            vocab_size = int(mc.get_vocab_size())
        self.vocab_size = int(vocab_size)
        self.context = context if context is not None else getattr(mc, "max_model_len", None)
        self.has_tokenizer = (
            has_tokenizer if has_tokenizer is not None else not llm_kwargs.get("skip_tokenizer_init", False)
        )
        self.version = int(version)
        self._pause = threading.Event()
        self._lock = threading.Lock()
        self._sp_cls: Any = sampling_params_cls

    def pause(self) -> None:
        """Make the running ``generate`` abort its unfinished samples and return them as ``"paused"``."""
        self._pause.set()

    def sleep(self) -> str | None:
        """Colocation hook (:func:`~posttrain.rollout.engine.engine_sleep`): vLLM's sleep mode, level 2 —
        weights and KV cache discarded, the next ``update_weights`` brings the weights. vLLM supports
        it on CUDA only, and only for an LLM built with ``enable_sleep_mode=True``; otherwise the
        reason is returned and nothing is released."""
        if not torch.cuda.is_available():
            return "vLLM sleep mode needs CUDA (vLLM supports it on the CUDA platform only); memory kept"
        if not self.sleep_mode:
            return "the vLLM engine was built without enable_sleep_mode=True; memory kept"
        with self._lock:
            self.llm.sleep(level=2)
        return None

    def wake(self) -> None:
        """Re-allocate what :meth:`sleep` released (``llm.wake_up()``); load the weights next."""
        with self._lock:
            self.llm.wake_up()

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Load HF-named tensors on every worker (``collective_rpc``), drop the prefix cache, bump ``version``.

        vLLM's ``load_weights`` copies into its existing parameters (fused projections are
        filled from the HF names). Waits for a running ``generate`` (call :meth:`pause` first).
        """
        # clone: tensors received over HTTP view a bytes buffer, which vLLM's RPC cannot pickle
        items = [(k, v.detach().clone()) for k, v in state_dict.items()]
        with self._lock:
            if items:
                self.llm.collective_rpc(_load_weights_on_worker, args=(items,))
            reset = getattr(self.llm, "reset_prefix_cache", None)
            if reset is not None:
                reset()
            self.version = self.version + 1 if version is None else int(version)

    def _sampling_params(self, kwargs: dict[str, Any]) -> Any:
        if self._sp_cls is None:
            self._sp_cls = require_vllm().SamplingParams
        return self._sp_cls(**kwargs)

    def generate(self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None) -> list[Completion]:
        """Protocol ``generate`` on vLLM: one vLLM request per sample, stepped until done, paused or target."""
        validate_requests(requests, vocab_size=self.vocab_size, context=self.context, has_tokenizer=self.has_tokenizer)
        if finish_target is not None and finish_target < 1:
            raise ValueError(f"finish_target must be >= 1, got {finish_target}")
        with self._lock:
            self._pause.clear()
            core = self.llm.llm_engine
            # (vllm id) -> (request index, request, sample index, seed)
            plan: dict[str, tuple[int, GenerationRequest, int, int]] = {}
            results: dict[str, Completion] = {}
            for qi, r in enumerate(requests):
                base = r.params.seed if r.params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
                # (sample index, seed, tokens, log-probs and versions so far)
                samples: list[tuple[int, int, list[int], list[float], list[int]]]
                if r.resume is not None:
                    c = r.resume
                    samples = [(c.sample_index, c.seed if c.seed is not None else base, list(c.token_ids),
                                list(c.logprobs), list(c.versions))]
                else:
                    samples = [(i, base, [], [], []) for i in range(r.params.n)]
                for si, seed, done, done_logprobs, done_versions in samples:
                    vid = f"{r.request_id}#{si}#{len(done)}"
                    plan[vid] = (qi, r, si, int(seed))
                    if len(done) >= r.params.max_new_tokens:  # nothing left: finished by length
                        results[vid] = Completion(r.request_id, si, list(r.prompt_ids), list(done),
                                                  done_logprobs, done_versions,
                                                  "length", params=r.params, seed=int(seed))
                        continue
                    kw = to_vllm_sampling_kwargs(r.params, seed=sample_seed(int(seed), si, len(done)), done_tokens=len(done))
                    core.add_request(vid, {"prompt_token_ids": list(r.prompt_ids) + done}, self._sampling_params(kw))
            latest: dict[str, Any] = {}
            n_finished = len(results)
            while core.has_unfinished_requests():
                if self._pause.is_set() or (finish_target is not None and n_finished >= finish_target):
                    open_ids = [v for v in plan if v not in results]
                    core.abort_request(open_ids)
                    break
                for out in core.step():
                    latest[out.request_id] = out
                    if out.finished:
                        qi, r, si, seed = plan[out.request_id]
                        results[out.request_id] = completion_from_output(
                            out.outputs[0], request=r, sample_index=si, seed=seed, version=self.version,
                            eos_ids=self.eos_ids)
                        n_finished += 1
            for vid, (_qi, r, si, seed) in plan.items():
                if vid in results:
                    continue
                if vid in latest:
                    results[vid] = completion_from_output(
                        latest[vid].outputs[0], request=r, sample_index=si, seed=seed, version=self.version,
                        eos_ids=self.eos_ids, finished=False)
                else:  # aborted before its first token
                    prior = r.resume
                    results[vid] = Completion(
                        r.request_id, si, list(r.prompt_ids), list(prior.token_ids) if prior else [],
                        list(prior.logprobs) if prior else [], list(prior.versions) if prior else [], "paused",
                        params=r.params, seed=seed)
            self._pause.clear()
        order = {vid: (plan[vid][0], plan[vid][2]) for vid in plan}
        return [results[v] for v in sorted(plan, key=lambda v: order[v])]


def build_vllm_engine(model: str, *, dtype: str = "float32", max_model_len: int | None = None,
                      kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.5, enforce_eager: bool = True,
                      seed: int = 0, eos_token_id: int | list[int] | None = None, version: int = 0,
                      sleep_mode: bool = False) -> VLLMEngine:
    """A :class:`VLLMEngine` on the Hugging Face model directory ``model`` (the server factory of
    ``rollout.engine=vllm``; keys as in ``rollout.vllm``).

    Without CUDA (vLLM's CPU build) the KV cache is ``kv_cache_gib`` GiB (``VLLM_CPU_KVCACHE_SPACE``,
    read when vLLM starts) and ``gpu_memory_utilization`` is not passed; with CUDA the reverse.
    ``sleep_mode`` (``system.engine_sleep``): build with ``enable_sleep_mode=True`` on CUDA (vLLM has no
    sleep mode elsewhere: the engine's ``sleep`` then says so).
    """
    # One process (engine core and worker in the server process): start-up imports vLLM once instead
    # of three times, and weight updates reach the model without a pickled RPC.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kwargs: dict[str, Any] = dict(dtype=dtype, seed=int(seed), enforce_eager=bool(enforce_eager),
                                  distributed_executor_backend="uni")
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    return VLLMEngine(model, eos_token_id=eos_token_id, version=version, **kwargs)
