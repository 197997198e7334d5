"""The Tinker API's operations on posttrain's parts: sessions, training models, samplers, checkpoints.

Each method takes a request body and returns ``(status, body, content_type)``. Operations that
compute are queued as :class:`~posttrain.serve.futures.Job` s and answer ``{request_id}`` at once;
one worker thread runs them (the models share one base network), the client fetches the outcome
with ``retrieve_future``. Errors the client can fix are ``{error, category: "user"}`` failures (or a
400 for a malformed request), never a silent approximation.

What a user who leaves the server running can count on:

- A training model's request that is refused (an unsupported chunk, a datum over the context, a
  negative learning rate) takes its ``seq_id`` and fails its own future with the ``user`` category; the
  model's later requests run (the SDK gives every request a turn whether or not it was accepted).
- A failure inside a batched engine call fails only the request that caused it: the batch is re-run
  one request at a time (counted in :attr:`TinkerService.batch_splits`).
- A ``forward_backward`` whose loss or gradient is not finite is refused and leaves the model's
  accumulated gradients as they were; an ``optim_step`` on non-finite gradients (or leaving non-finite
  weights) is refused and not applied. Replies are strict JSON (no ``NaN`` literal).
- The model's context (``max_context_length``) holds on every route: a datum of ``forward`` /
  ``forward_backward``, and ``prompt + max_tokens`` of ``sample`` / ``compute_logprobs``.
- Memory freed by a request goes back to the system: glibc keeps freed heap memory of a long
  ``forward_backward`` (a 2000-token datum on SmolLM2-135M left the RSS at 5.4 GB instead of 1.0 GB), so
  after a job that grew the RSS by more than ``TRIM_ABOVE_MB`` the worker calls ``malloc_trim(0)``; a
  server (:func:`~posttrain.serve.tinker_app.make_server`) also serves blocks of ``MMAP_THRESHOLD_MB`` or
  more from their own mappings (:func:`return_large_blocks`), so the peak RSS of one request follows its
  live tensors instead of the heap's high-water mark.
- Memory of a long datum is bounded: the hub runs it through the chunked LM head with activation
  checkpointing (:mod:`posttrain.serve.tinker_models`); a ``forward_backward`` datum of more than
  ``max_datum_tokens`` tokens (``posttrain serve --max-datum-tokens``) is refused naming the limit.
- Clients take turns (:class:`~posttrain.serve.futures.JobQueue`); ``cancel_future`` drops a queued
  request; a finished session, or one without a heartbeat for ``session_timeout_s`` (the SDK beats
  every 10 s), has its queued work dropped and its later requests refused.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import dataclasses
import json
import math
import os
import sys
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.errors import UserError
from posttrain.serve import checkpoints
from posttrain.serve.futures import JSON, PROTOBUF, FutureTable, Job, JobQueue, Outcome, failure
from posttrain.serve.sampling import SampleCall, Sampler, sample_call
from posttrain.serve.tinker_models import AdamStep, LoraSpec, ModelHub
from posttrain.serve.wire import (
    RefusedRequest,
    decode_forward_backward,
    encode_forward_backward,
    encode_sample,
)

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

Reply = tuple[int, bytes, str]
Snapshot = tuple[LoraSpec, Mapping[str, torch.Tensor]]

RETRIEVE_WAIT_S = 30.0
"""How long one ``retrieve_future`` waits for a result before answering ``try_again`` (the SDK polls again)."""

SESSION_TIMEOUT_S = 60.0
"""A session without a heartbeat for this long is over: its queued work is dropped (the SDK beats every 10 s)."""

TRIM_ABOVE_MB = 256
"""After a job that left the RSS this much above its level after the last trim, free heap memory is returned."""

MMAP_THRESHOLD_MB = 1
"""Heap blocks of this size or more get their own mapping, returned to the system when freed (:func:`return_large_blocks`)."""

MAX_DATUM_TOKENS = 8192
"""Default longest ``forward_backward`` datum (``max_datum_tokens``): SmolLM2-135M's whole context, which peaks
1.1 GB above the idle RSS with the chunked head and activation checkpointing (docs/tinker.md, "Long data are
bounded")."""

_SEQ_MEMORY = 65536

CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "sample_join_sampling_session": False, "custom_loss_server_side": False}
"""Feature flags for the SDK: API keys (no JWT exchange), plain httpx, no server-side custom losses."""

DYNAMIC_CONFIG = {"sample_cancel_enabled": True}
"""The SDK's refreshed flags: an abandoned sample future sends ``cancel_future`` (which drops it here)."""

REFUSALS = (UserError, ValueError, KeyError, TypeError)
"""Errors in a request's content: a 400 ``{detail}``, or a user-category failure of an ordered request."""


def refusal_message(e: BaseException) -> str:
    """The one-line message of a refused request (a ``KeyError`` is a missing field)."""
    return f"missing field {e}" if isinstance(e, KeyError) else str(e)


def dumps(obj: object) -> bytes:
    """Strict JSON (``ValueError`` for NaN / infinity, which JSON has no literal for)."""
    return json.dumps(obj, allow_nan=False).encode()


def reply(obj: object, status: int = 200) -> Reply:
    """A JSON reply."""
    return status, dumps(obj), JSON


def rss_mb() -> float | None:
    """This process's resident set size in MB (None where ``/proc`` is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def release_memory() -> bool:
    """Return free heap memory to the system (glibc ``malloc_trim(0)``); whether that was possible.

    glibc serves allocations below its mmap threshold (raised dynamically up to 32 MB as large blocks are
    freed) from arenas that keep freed pages: the activations of a long ``forward_backward`` stay resident
    after the tensors are gone unless the arenas are trimmed."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def return_large_blocks(threshold_mb: float = MMAP_THRESHOLD_MB) -> bool:
    """Serve heap blocks of ``threshold_mb`` or more from their own mappings (glibc
    ``mallopt(M_MMAP_THRESHOLD, ...)``, process-wide); whether that was possible.

    glibc raises its mmap threshold as large blocks are freed (up to 32 MB), after which a long
    ``forward_backward``'s activations come from the arena, whose freed pages stay resident and fragment:
    a 2000-token datum on SmolLM2-135M (chunked head, activation checkpointing) peaked at 3.1 GB RSS, 1.5 GB
    with a fixed 1 MB threshold, in the same time. A fixed threshold stops the raising."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(-3, int(threshold_mb * 2**20)))  # M_MMAP_THRESHOLD


def _json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body or b"{}")
    except json.JSONDecodeError as e:
        raise UserError(f"request body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise UserError("request body must be a JSON object")
    return obj


def session_of(some_id: str) -> str:
    """The session a model id (``<session>:train:<n>``) or sampling session id (``<session>:sample:<n>``) belongs to."""
    return some_id.split(":", 1)[0]


def _page(items: list[Any], query: Mapping[str, str], default_limit: int) -> tuple[list[Any], dict[str, int]]:
    """``items[offset : offset + limit]`` and the SDK's ``Cursor``."""
    try:
        limit, offset = int(query.get("limit", default_limit)), int(query.get("offset", 0))
    except ValueError:
        raise UserError(f"limit / offset must be integers, got {dict(query)}") from None
    if limit < 0 or offset < 0:
        raise UserError(f"limit / offset must be >= 0, got limit={limit} offset={offset}")
    return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


@dataclasses.dataclass
class _Sampler:
    """A sampling session: the base model (``key`` "base") or a snapshot's key (its tinker path or an id)."""

    base_model: str
    key: str
    model_path: str | None


class TinkerService:
    """State of one server: the model hub, the sampler, futures, sessions and snapshots."""

    def __init__(self, base_model: str, model: torch.nn.Module, tokenizer: Tokenizer | None, state_dir: Path,
                 *, snapshot_capacity: int = 16, session_timeout_s: float = SESSION_TIMEOUT_S,
                 max_datum_tokens: int = MAX_DATUM_TOKENS) -> None:
        if max_datum_tokens < 1:
            raise ValueError(f"max_datum_tokens must be >= 1, got {max_datum_tokens}")
        self.max_datum_tokens = max_datum_tokens
        self.base_model = base_model
        self.tokenizer = tokenizer
        self.state_dir = state_dir
        self.sampler = Sampler(model, tokenizer)  # copies the base before any adapter is added
        self.vocab_size = int(self.sampler.model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
        self.hub = ModelHub(base_model, model)
        self.futures = FutureTable()
        self.queue = JobQueue()
        self.sessions: dict[str, bool] = {}  # id -> over (finished by the client, or expired)
        self.session_timeout_s = session_timeout_s
        self._seen: dict[str, float] = {}  # session id -> time.monotonic() of its last heartbeat
        self.declared: dict[str, LoraSpec] = {}  # model ids accepted (created or being created)
        self._used: dict[str, float] = {}  # model id -> time.time() of its last request
        self._metadata: dict[str, dict[str, str]] = {}  # model id -> create_model's / load_weights' user_metadata
        self.samplers: dict[str, _Sampler] = {}
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self.batch_splits = 0  # batched engine calls that failed and were re-run one request at a time
        self.trims = 0  # malloc_trim calls after jobs that grew the RSS (see release_memory)
        self.trim_above_mb: float = TRIM_ABOVE_MB
        self._rss_floor = rss_mb()
        self._capacity = snapshot_capacity
        self._lock = threading.Lock()
        # (model id or sampling session, seq_id) -> request id, the newest _SEQ_MEMORY (a retry comes within seconds)
        self._by_seq: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._work, name="tinker-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ worker
    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker (after its current job), waiting at most ``timeout`` s."""
        self._stop.set()
        self.queue.close()
        self._worker.join(timeout)

    def _work(self) -> None:
        while not self._stop.is_set():
            self.expire_sessions()
            jobs = self.queue.take(0.5)
            if not jobs:
                continue
            outcomes = self._run(jobs)
            self._trim()
            for j, o in zip(jobs, outcomes, strict=True):
                self.futures.resolve(j.request_id, o)

    def _trim(self) -> None:
        """:func:`release_memory` when the RSS is ``trim_above_mb`` above its level after the last trim."""
        now = rss_mb()
        if now is None or self._rss_floor is None or now - self._rss_floor < self.trim_above_mb:
            return
        if release_memory():
            self.trims += 1
        self._rss_floor = rss_mb()

    def _run(self, jobs: Sequence[Job]) -> list[Outcome]:
        """One outcome per job; a batch whose engine call fails is re-run one job at a time, so that an
        error is the outcome of the request that caused it only."""
        if len(jobs) > 1 and jobs[0].batch_work is not None:
            try:
                return jobs[0].batch_work(jobs)
            except Exception:  # noqa: BLE001  (counted in batch_splits; each job's own error comes from its re-run)
                self.batch_splits += 1
        return [self._run_one(j) for j in jobs]

    @staticmethod
    def _run_one(job: Job) -> Outcome:
        try:
            return job.work()
        except (UserError, ValueError) as e:
            return failure(str(e), user=True)
        except Exception as e:  # noqa: BLE001  (the client gets a server-category failure; the traceback goes to stderr)
            traceback.print_exc(file=sys.stderr)
            return failure(f"{type(e).__name__}: {e}", user=False)

    def _submit(self, work: Callable[[], Outcome], *, order_key: str | None = None, seq: int | None = None,
                client: str = "", extra: Mapping[str, object] | None = None) -> Reply:
        """Queue ``work``; a request sent again with the same ``(order_key, seq)`` (the SDK's HTTP client
        retries after a lost reply) gets the first one's ``request_id`` instead of running twice."""
        with self._lock:
            rid = self._by_seq.get((order_key, seq)) if order_key is not None and seq is not None else None
            if rid is None:
                rid = str(uuid.uuid4())
                self.futures.add(rid)
                try:
                    self.queue.submit(Job(rid, work, order_key, seq, client=client))
                except UserError:
                    self.futures.forget(rid)
                    raise
                if order_key is not None and seq is not None:
                    self._note_seq((order_key, seq), rid)
        return reply({"request_id": rid, **(extra or {})})

    def _ordered(self, mid: str, seq: object, prepare: Callable[[], Callable[[], Outcome]],
                 extra: Mapping[str, object] | None = None) -> Reply:
        """Queue the request of model ``mid`` at ``seq``: ``prepare()`` validates it and returns its work.
        A refusal (or a finished session) still takes ``seq``, as a job failing with the user category; an
        unexpected error in ``prepare`` (a bug) likewise, with the server category."""
        seq_id = None if seq is None else int(seq)  # type: ignore[call-overload]
        try:
            self._check_live(session_of(mid))
            work = prepare()
        except REFUSALS as e:
            if seq_id is None:
                raise
            message = refusal_message(e)
            work = lambda: failure(message, user=True)  # noqa: E731
        except Exception as e:  # noqa: BLE001  (a bug: the request's own server-category failure, not a 500 the SDK retries)
            if seq_id is None:
                raise
            traceback.print_exc(file=sys.stderr)
            crash = f"{type(e).__name__}: {e}"
            work = lambda: failure(crash, user=False)  # noqa: E731
        self._used[mid] = time.time()
        return self._submit(work, order_key=mid, seq=seq_id, client=session_of(mid), extra=extra)

    def _note_seq(self, key: tuple[str, int], rid: str) -> None:
        self._by_seq[key] = rid
        while len(self._by_seq) > _SEQ_MEMORY:
            self._by_seq.popitem(last=False)

    def _drop(self, keep: Callable[[Job], bool], why: str) -> int:
        """Drop queued jobs (``keep`` false), failing their futures with ``why``; how many."""
        gone = self.queue.drop(keep)
        for j in gone:
            self.futures.resolve(j.request_id, failure(why, user=True))
        return len(gone)

    # ------------------------------------------------------------------ session
    def client_config(self, body: bytes) -> Reply:
        """``POST /api/v1/client/config``: the feature flags."""
        return reply(CLIENT_CONFIG)

    def dynamic_config(self, body: bytes) -> Reply:
        """``POST /api/v1/client/dynamic_config``: the refreshed flags (sampling cancellation on)."""
        return reply(DYNAMIC_CONFIG)

    def create_session(self, body: bytes) -> Reply:
        """``POST /api/v1/create_session``."""
        sid = str(uuid.uuid4())
        self.sessions[sid] = False
        self._seen[sid] = time.monotonic()
        return reply({"type": "create_session", "session_id": sid})

    def _check_live(self, sid: str) -> None:
        if self.sessions.get(sid):
            raise UserError(f"session {sid!r} is over (finished, or no heartbeat for {self.session_timeout_s:g} s)")

    def heartbeat(self, body: bytes) -> Reply:
        """``POST /api/v1/session_heartbeat`` (410 once the session is over: the SDK stops its loop)."""
        sid = str(_json(body).get("session_id"))
        if self.sessions.get(sid) is None:
            return reply({"detail": f"unknown session {sid!r}"}, 404)
        if self.sessions[sid]:
            return reply({"detail": f"session {sid!r} is over"}, 410)
        self._seen[sid] = time.monotonic()
        return reply({"type": "session_heartbeat"})

    def _end_session(self, sid: str, why: str) -> None:
        self.sessions[sid] = True
        self._drop(lambda j: j.client != sid, f"session {sid!r} {why}: its queued request was dropped")

    def finish_session(self, sid: str) -> Reply:
        """``POST /api/v1/sessions/{id}/finish``: the session is over; its queued work is dropped."""
        if sid not in self.sessions:
            return reply({"detail": f"unknown session {sid!r}"}, 404)
        self._end_session(sid, "was finished by the client")
        return reply({})

    def expire_sessions(self) -> list[str]:
        """End the live sessions without a heartbeat for ``session_timeout_s`` (their queued work is
        dropped); the ids ended. The worker calls it between jobs."""
        now = time.monotonic()
        gone = [sid for sid, over in list(self.sessions.items())
                if not over and now - self._seen.get(sid, now) > self.session_timeout_s]
        for sid in gone:
            self._end_session(sid, f"sent no heartbeat for {self.session_timeout_s:g} s")
        return gone

    def cancel_future(self, body: bytes) -> Reply:
        """``POST /api/v1/cancel_future``: drop the request if it is still queued (one running finishes)."""
        rid = str(_json(body).get("request_id"))
        self._drop(lambda j: j.request_id != rid, f"request {rid} was cancelled by the client (cancel_future)")
        return reply({})

    def capabilities(self, body: bytes) -> Reply:
        """``/api/v1/get_server_capabilities``: the one served model."""
        return reply({"supported_models": [{"model_name": self.base_model, "trainable": True, "sampleable": True,
                                            "max_context_length": self.sampler.context}]})

    def list_sessions(self, query: Mapping[str, str]) -> Reply:
        """``GET /api/v1/sessions`` (``limit`` 20, ``offset``): the session ids, oldest first."""
        page, _ = _page(list(self.sessions), query, 20)
        return reply({"sessions": page})

    def get_session(self, sid: str) -> Reply:
        """``GET /api/v1/sessions/{id}``: its training runs and samplers."""
        if sid not in self.sessions:
            return reply({"detail": f"unknown session {sid!r}"}, 404)
        return reply({"training_run_ids": [m for m in self.declared if session_of(m) == sid],
                      "sampler_ids": [s for s in self.samplers if session_of(s) == sid]})

    # ------------------------------------------------------------------ training
    def _check_base(self, name: object) -> None:
        if name != self.base_model:
            raise UserError(f"base_model {name!r} is not served here (this server serves {self.base_model!r})")

    def create_model(self, body: bytes) -> Reply:
        """``POST /api/v1/create_model``: a LoRA training model ``<session>:train:<model_seq_id>``."""
        req = _json(body)
        self._check_base(req.get("base_model"))
        self._check_live(str(req["session_id"]))
        opt = (req.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserError(f"optimizer {opt!r} is not supported by posttrain serve (adamw only)")
        lc = req.get("lora_config")
        if not isinstance(lc, dict):
            raise UserError("create_model: only LoRA training is supported (lora_config is required)")
        spec = LoraSpec(int(lc["rank"]), lc.get("seed"), bool(lc.get("train_mlp", True)),
                        bool(lc.get("train_attn", True)), bool(lc.get("train_unembed", True)))
        model_id = f"{req['session_id']}:train:{int(req['model_seq_id'])}"
        if model_id in self.declared:
            raise UserError(f"model {model_id!r} exists already")
        self.declared[model_id] = spec
        self._used[model_id] = time.time()
        self._note_metadata(model_id, req)
        self.queue.open_order(model_id, 1)

        def work() -> Outcome:
            self.hub.create(model_id, spec)
            return Outcome(dumps({"model_id": model_id, "type": "create_model"}))

        return self._submit(work, client=session_of(model_id), extra={"model_id": model_id})

    def _note_metadata(self, mid: str, req: Mapping[str, Any]) -> None:
        meta = req.get("user_metadata")
        if isinstance(meta, dict):
            self._metadata[mid] = {str(k): str(v) for k, v in meta.items()}

    def _model(self, req: Mapping[str, Any]) -> str:
        mid = str(req.get("model_id"))
        if mid not in self.declared:
            raise UserError(f"unknown model_id {mid!r}")
        return mid

    def get_info(self, body: bytes) -> Reply:
        """``POST /api/v1/get_info`` (answered directly)."""
        mid = self._model(_json(body))
        tok_id = None if self.base_model.startswith("builtin:") else self.base_model
        return reply({"type": "get_info", "model_id": mid, "is_lora": True, "lora_rank": self.declared[mid].rank,
                      "model_name": self.base_model,
                      "model_data": {"arch": type(self.sampler.model).__name__, "model_name": self.base_model,
                                     "tokenizer_id": tok_id}})

    def forward_backward(self, body: bytes) -> Reply:
        """``POST /api/v1/forward_backward`` (protobuf request and result; ``forward_only`` = ``/forward``).

        Refused (user category, the model unchanged): content the wire format does not take, a datum
        longer than the context, a loss or gradient that is not finite."""
        try:
            req = decode_forward_backward(body)
        except RefusedRequest as e:
            return self._ordered(self._model({"model_id": e.model_id}), e.seq_id, _refused(str(e)))
        mid = self._model({"model_id": req.model_id})
        route = "forward" if req.forward_only else "forward_backward"

        def prepare() -> Callable[[], Outcome]:
            ctx = self.sampler.context
            for i, d in enumerate(req.data):
                if ctx is not None and len(d.tokens) > ctx:
                    raise UserError(f"{route} datum {i}: {len(d.tokens)} tokens exceed the model's context of "
                                    f"{ctx} tokens (max_context_length)")
                if not req.forward_only and len(d.tokens) > self.max_datum_tokens:
                    raise UserError(f"{route} datum {i}: {len(d.tokens)} tokens exceed this server's limit of "
                                    f"{self.max_datum_tokens} tokens per forward_backward datum (posttrain serve "
                                    f"--max-datum-tokens); split it, or restart the server with a higher limit")
            return work

        def work() -> Outcome:
            params = [] if req.forward_only else self.hub.get(mid).params
            grads = [None if p.grad is None else p.grad.clone() for p in params]
            try:
                res = self.hub.forward_backward(mid, req.data, req.loss_fn, req.loss_fn_config,
                                                forward_only=req.forward_only)
                if not math.isfinite(res.loss_sum):
                    raise UserError(f"{route}: the loss is not finite (loss:sum = {res.loss_sum}); refused, the "
                                    f"model's gradients are as they were")
                if not all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params):
                    raise UserError(f"{route}: the gradient is not finite; refused, the model's gradients are as they were")
            except BaseException:
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                raise
            finally:
                del grads
            return Outcome(encode_forward_backward(res.logprobs, {"loss:sum": res.loss_sum}), PROTOBUF)

        return self._ordered(mid, req.seq_id, prepare)

    def optim_step(self, body: bytes) -> Reply:
        """``POST /api/v1/optim_step`` (Adam parameters; other optimizers are refused). Refused (user
        category, nothing applied): a learning rate, beta, eps, weight decay or clip norm out of its domain,
        non-finite gradients, or a step that would leave non-finite weights."""
        req = _json(body)
        mid = self._model(req)

        def prepare() -> Callable[[], Outcome]:
            params = req.get("adam_params")
            if not isinstance(params, dict):
                raise UserError("optim_step: only Adam is supported (adam_params)")
            unknown = sorted(set(params) - {f.name for f in dataclasses.fields(AdamStep)})
            if unknown:
                raise UserError(f"optim_step: unknown adam_params {unknown}")
            step = AdamStep(**{k: float(v) for k, v in params.items()})
            _check_adam(step)
            return lambda: self._optim_step(mid, step)

        return self._ordered(mid, req.get("seq_id"), prepare)

    def _optim_step(self, mid: str, step: AdamStep) -> Outcome:
        tm = self.hub.get(mid)
        if not all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in tm.params):
            raise UserError("optim_step: the accumulated gradient is not finite; the step is not applied")
        before = [p.detach().clone() for p in tm.params]
        opt_state = copy.deepcopy(tm.optimizer.state_dict())
        grads = [None if p.grad is None else p.grad.clone() for p in tm.params]
        metrics = self.hub.optim_step(mid, step)
        if not all(math.isfinite(v) for v in metrics.values()) or not all(
                bool(torch.isfinite(p).all()) for p in tm.params):
            with torch.no_grad():
                for p, b, g in zip(tm.params, before, grads, strict=True):
                    p.copy_(b)
                    p.grad = g
            tm.optimizer.load_state_dict(opt_state)
            tm.steps -= 1
            raise UserError(f"optim_step: the step would leave non-finite weights or metrics {metrics}; not applied")
        return Outcome(dumps({"metrics": metrics}))

    # ------------------------------------------------------------------ checkpoints
    def _remember(self, key: str, snap: Snapshot) -> None:
        self.snapshots[key] = snap
        self.snapshots.move_to_end(key)
        while len(self.snapshots) > self._capacity:
            self.snapshots.popitem(last=False)

    def _write(self, path: checkpoints.TinkerPath, mid: str, snap: Snapshot, optimizer: dict[str, Any] | None,
               ttl_seconds: object) -> None:
        self.sampler.load(path.uri, lambda: self.hub.merged(snap))
        checkpoints.write(path, self.state_dir, step=self.hub.get(mid).steps, actor=self.sampler.model,
                          tokenizer=self.tokenizer,
                          saved=checkpoints.Saved(self.base_model, snap[0], dict(snap[1]), optimizer))
        if ttl_seconds is not None:
            checkpoints.set_ttl(path, self.state_dir, ttl_seconds)  # type: ignore[arg-type]

    def save_weights(self, body: bytes) -> Reply:
        """``POST /api/v1/save_weights`` (``save_state``): adapter + optimizer to ``tinker://<model>/weights/<name>``."""
        req = _json(body)
        mid = self._model(req)

        def prepare() -> Callable[[], Outcome]:
            path = checkpoints.parse_path(f"tinker://{mid}/weights/{req.get('path') or uuid.uuid4().hex[:8]}")

            def work() -> Outcome:
                snap = (self.declared[mid], self.hub.adapter_state(mid))
                self._write(path, mid, snap, self.hub.get(mid).optimizer.state_dict(), req.get("ttl_seconds"))
                return Outcome(dumps({"path": path.uri, "type": "save_weights"}))

            return work

        return self._ordered(mid, req.get("seq_id"), prepare)

    def save_weights_external(self, body: bytes) -> Reply:
        """``POST /api/v1/save_weights_external``: not implemented; refused at its ``seq_id`` (user category)."""
        req = _json(body)
        return self._ordered(self._model(req), req.get("seq_id"), _refused(
            "save_weights_external is not implemented by posttrain serve (use save_state: the checkpoint's "
            "actor/ folder is a Hugging Face model)"))

    def save_for_sampler(self, body: bytes) -> Reply:
        """``POST /api/v1/save_weights_for_sampler``: a named checkpoint (``path``), or, without a name, a
        sampling session on an in-memory snapshot (``sampling_session_id``)."""
        req = _json(body)
        mid = self._model(req)

        def prepare() -> Callable[[], Outcome]:
            name = req.get("path")
            if name is None and req.get("sampling_session_seq_id") is None:
                raise UserError("save_weights_for_sampler: give a path or a sampling_session_seq_id")
            path = None if name is None else checkpoints.parse_path(f"tinker://{mid}/sampler_weights/{name}")
            sid = None if path is not None else f"{session_of(mid)}:sample:{int(req['sampling_session_seq_id'])}"

            def work() -> Outcome:
                snap: Snapshot = (self.declared[mid], self.hub.adapter_state(mid))
                if path is not None:
                    self._write(path, mid, snap, None, req.get("ttl_seconds"))
                    self._remember(path.uri, snap)
                    return Outcome(dumps({"path": path.uri, "type": "save_weights_for_sampler"}))
                assert sid is not None
                self._remember(sid, snap)
                self.samplers[sid] = _Sampler(self.base_model, sid, None)
                return Outcome(dumps({"sampling_session_id": sid, "type": "save_weights_for_sampler"}))

            return work

        return self._ordered(mid, req.get("seq_id"), prepare)

    def load_weights(self, body: bytes) -> Reply:
        """``POST /api/v1/load_weights``: into an existing model (``model_id`` + ``seq_id``) or creating one
        (``session_id`` + ``model_seq_id``); with or without the optimizer state. The model's step count
        (which numbers its checkpoint folders) becomes the checkpoint's."""
        req = _json(body)
        with_opt = bool(req.get("optimizer"))
        if req.get("session_id") is not None:
            path = checkpoints.parse_path(str(req.get("path")))
            self._check_live(str(req["session_id"]))
            mid = f"{req['session_id']}:train:{int(req['model_seq_id'])}"
            saved = checkpoints.read(path, self.state_dir)
            self._check_base(req.get("base_model") or saved.base_model)
            if mid in self.declared:
                raise UserError(f"model {mid!r} exists already")
            self.declared[mid] = saved.lora
            self._used[mid] = time.time()
            self._note_metadata(mid, req)
            self.queue.open_order(mid, 1)
            return self._submit(self._load_work(mid, path, with_opt), client=session_of(mid), extra={"model_id": mid})
        mid = self._model(req)

        def prepare() -> Callable[[], Outcome]:
            return self._load_work(mid, checkpoints.parse_path(str(req.get("path"))), with_opt)

        return self._ordered(mid, req.get("seq_id"), prepare, extra={"model_id": mid})

    def _load_work(self, mid: str, path: checkpoints.TinkerPath, with_opt: bool) -> Callable[[], Outcome]:
        def work() -> Outcome:
            saved = checkpoints.read(path, self.state_dir)
            if mid not in self.hub.models:
                self.hub.create(mid, saved.lora)
            if saved.lora != self.declared[mid]:
                raise UserError(f"{path.uri}: LoRA config {saved.lora} differs from model {mid!r}'s {self.declared[mid]}")
            if with_opt and saved.optimizer is None:
                raise UserError(f"{path.uri} holds no optimizer state (a sampler checkpoint)")
            self.hub.load_adapter_state(mid, saved.adapter)
            tm = self.hub.get(mid)
            if with_opt:
                assert saved.optimizer is not None
                tm.optimizer.load_state_dict(saved.optimizer)
            tm.steps = saved.step
            return Outcome(dumps({"path": path.uri, "model_id": mid, "type": "load_weights"}))

        return work

    # ------------------------------------------------------------------ REST: runs, checkpoints, weights info
    def _run_record(self, mid: str, listed: Sequence[checkpoints.Listed]) -> dict[str, Any]:
        mine = [c for c in listed if c.path.model_id == mid]
        train = [c for c in mine if c.path.kind == "weights"]
        samp = [c for c in mine if c.path.kind == "sampler_weights"]
        lora = self.declared.get(mid) or mine[-1].lora
        last = self._used.get(mid) or max(c.time for c in mine)
        return {"training_run_id": mid, "base_model": mine[-1].base_model if mine else self.base_model,
                "model_owner": "local", "is_lora": True, "corrupted": False, "lora_rank": lora.rank,
                "last_request_time": checkpoints.iso_time(last),
                "last_checkpoint": train[-1].record() if train else None,
                "last_sampler_checkpoint": samp[-1].record() if samp else None,
                "user_metadata": self._metadata.get(mid)}

    def _run_ids(self, listed: Sequence[checkpoints.Listed]) -> list[str]:
        return list(dict.fromkeys([c.path.model_id for c in listed] + list(self.declared)))

    def list_training_runs(self, query: Mapping[str, str]) -> Reply:
        """``GET /api/v1/training_runs`` (``limit`` 20, ``offset``): the models of this server and those
        with checkpoints under the state directory."""
        listed = checkpoints.listing(self.state_dir)
        page, cursor = _page(self._run_ids(listed), query, 20)
        return reply({"training_runs": [self._run_record(m, listed) for m in page], "cursor": cursor})

    def get_training_run(self, mid: str) -> Reply:
        """``GET /api/v1/training_runs/{id}``."""
        listed = checkpoints.listing(self.state_dir)
        if mid not in self._run_ids(listed):
            return reply({"detail": f"unknown training run {mid!r}"}, 404)
        return reply(self._run_record(mid, listed))

    def list_checkpoints(self, mid: str) -> Reply:
        """``GET /api/v1/training_runs/{id}/checkpoints``: its checkpoints, oldest first."""
        listed = [c for c in checkpoints.listing(self.state_dir) if c.path.model_id == mid]
        if not listed and mid not in self.declared:
            return reply({"detail": f"unknown training run {mid!r}"}, 404)
        return reply({"checkpoints": [c.record() for c in listed]})

    def list_user_checkpoints(self, query: Mapping[str, str]) -> Reply:
        """``GET /api/v1/checkpoints`` (``limit`` 100, ``offset``): every checkpoint, oldest first."""
        page, cursor = _page(checkpoints.listing(self.state_dir), query, 100)
        return reply({"checkpoints": [c.record() for c in page], "cursor": cursor})

    def _checkpoint(self, mid: str, checkpoint_id: str) -> checkpoints.TinkerPath:
        return checkpoints.parse_path(f"tinker://{mid}/{checkpoint_id}")

    def delete_checkpoint(self, mid: str, checkpoint_id: str) -> Reply:
        """``DELETE /api/v1/training_runs/{id}/checkpoints/{kind}/{name}``: removes its folder."""
        path = self._checkpoint(mid, checkpoint_id)
        checkpoints.delete(path, self.state_dir)
        self.snapshots.pop(path.uri, None)
        return reply({})

    def set_checkpoint_ttl(self, mid: str, checkpoint_id: str, body: bytes) -> Reply:
        """``PUT /api/v1/training_runs/{id}/checkpoints/{kind}/{name}/ttl`` ``{ttl_seconds}`` (null: never expires)."""
        checkpoints.set_ttl(self._checkpoint(mid, checkpoint_id), self.state_dir, _json(body).get("ttl_seconds"))
        return reply({})

    def weights_info(self, body: bytes) -> Reply:
        """``POST /api/v1/weights_info`` ``{tinker_path}``: base model and LoRA config of a checkpoint."""
        path = checkpoints.parse_path(str(_json(body).get("tinker_path")))
        found = [c for c in checkpoints.listing(self.state_dir) if c.path == path]
        if not found:
            return reply({"detail": f"no checkpoint at {path.uri}"}, 404)
        lora = found[-1].lora
        return reply({"base_model": found[-1].base_model, "is_lora": True, "lora_rank": lora.rank,
                      "train_unembed": lora.train_unembed, "train_mlp": lora.train_mlp,
                      "train_attn": lora.train_attn})

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, body: bytes) -> Reply:
        """``POST /api/v1/create_sampling_session`` on a ``tinker://`` path or the base model."""
        req = _json(body)
        self._check_live(str(req["session_id"]))
        sid = f"{req['session_id']}:sample:{int(req['sampling_session_seq_id'])}"
        mp = req.get("model_path")
        if mp is not None:
            path = checkpoints.parse_path(str(mp))
            self.samplers[sid] = _Sampler(self.base_model, path.uri, path.uri)
        else:
            self._check_base(req.get("base_model"))
            self.samplers[sid] = _Sampler(self.base_model, "base", None)
        return reply({"type": "create_sampling_session", "sampling_session_id": sid})

    def get_sampler(self, sid: str) -> Reply:
        """``GET /api/v1/samplers/{id}``."""
        s = self.samplers.get(sid)
        if s is None:
            return reply({"detail": f"unknown sampler {sid!r}"}, 404)
        return reply({"sampler_id": sid, "base_model": s.base_model, "model_path": s.model_path})

    def _snapshot(self, key: str) -> Snapshot | None:
        if key == "base":
            return None
        snap = self.snapshots.get(key)
        if snap is None:
            if not key.startswith("tinker://"):
                raise UserError(f"sampler weights {key!r} are no longer held (unnamed snapshots are kept in memory only)")
            saved = checkpoints.read(checkpoints.parse_path(key), self.state_dir)
            self._check_base(saved.base_model)
            snap = (saved.lora, saved.adapter)
            self._remember(key, snap)
        return snap

    def _sample_batch(self, jobs: Sequence[Job]) -> list[Outcome]:
        key = str(jobs[0].batch_key)
        self.sampler.load(key, lambda: self.hub.merged(self._snapshot(key)))
        calls = [j.payload for j in jobs]
        assert all(isinstance(c, SampleCall) for c in calls)
        results = self.sampler.run(calls)  # type: ignore[arg-type]
        return [Outcome(encode_sample(r.sequences, r.prompt_logprobs), PROTOBUF) for r in results]

    def asample(self, body: bytes) -> Reply:
        """``POST /api/v1/asample``: sample from a sampling session (or a ``model_path`` / ``base_model``).
        A request that cannot run (see :func:`~posttrain.serve.sampling.sample_call`) is a 400 naming it."""
        req = _json(body)
        sid = req.get("sampling_session_id")
        client = ""
        if sid is not None:
            s = self.samplers.get(str(sid))
            if s is None:
                raise UserError(f"unknown sampling_session_id {sid!r}")
            key, client = s.key, session_of(str(sid))
            self._check_live(client)
        elif req.get("model_path") is not None:
            key = checkpoints.parse_path(str(req["model_path"])).uri
        else:
            self._check_base(req.get("base_model"))
            key = "base"
        chunks = (req.get("prompt") or {}).get("chunks") or []
        prompt: list[int] = []
        for c in chunks:
            if c.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"sample: {c.get('type')} chunks are not supported by posttrain serve (token chunks only)")
            prompt += [int(t) for t in c["tokens"]]
        seq = req.get("seq_id")
        dedupe = (str(sid), int(seq)) if sid is not None and seq is not None else None
        with self._lock:
            rid = self._by_seq.get(dedupe) if dedupe is not None else None
            if rid is None:
                rid = str(uuid.uuid4())
                call = sample_call(rid, req, prompt, self.sampler.context, self.vocab_size)
                self.futures.add(rid)
                job = Job(rid, lambda: self._sample_batch([job])[0], batch_key=key, batch_work=self._sample_batch,
                          payload=call, client=client)
                self.queue.submit(job)
                if dedupe is not None:
                    self._note_seq(dedupe, rid)
        n = int(req.get("num_samples", 1))
        return reply({"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]})

    # ------------------------------------------------------------------ futures
    def retrieve(self, body: bytes) -> Reply:
        """``POST /api/v1/retrieve_future``: the result, a failure, or ``try_again`` after a bounded wait."""
        rid = str(_json(body).get("request_id"))
        try:
            out = self.futures.wait(rid, RETRIEVE_WAIT_S)
        except KeyError:
            return reply({"detail": f"unknown request_id {rid!r}"}, 404)
        if out is None:
            return reply({"type": "try_again", "request_id": rid, "queue_state": "active"})
        return 200, out.body, out.content_type


def _refused(message: str) -> Callable[[], Callable[[], Outcome]]:
    """A ``prepare`` (see :meth:`TinkerService._ordered`) that refuses with ``message``."""

    def prepare() -> Callable[[], Outcome]:
        raise UserError(message)

    return prepare


def _check_adam(step: AdamStep) -> None:
    """``UserError`` unless ``learning_rate >= 0``, ``0 <= beta1, beta2 < 1``, ``eps >= 0``,
    ``weight_decay >= 0``, ``grad_clip_norm >= 0`` (all finite)."""
    bad = [f"{k}={v}" for k, v, ok in (
        ("learning_rate", step.learning_rate, step.learning_rate >= 0),
        ("beta1", step.beta1, 0 <= step.beta1 < 1), ("beta2", step.beta2, 0 <= step.beta2 < 1),
        ("eps", step.eps, step.eps >= 0), ("weight_decay", step.weight_decay, step.weight_decay >= 0),
        ("grad_clip_norm", step.grad_clip_norm, step.grad_clip_norm >= 0),
    ) if not (math.isfinite(v) and ok)]
    if bad:
        raise UserError(f"optim_step: adam_params out of range: {', '.join(bad)} (learning_rate, eps, weight_decay, "
                        f"grad_clip_norm >= 0; 0 <= beta1, beta2 < 1; all finite)")
