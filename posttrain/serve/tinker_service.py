"""The Tinker API's operations on posttrain's parts: sessions, training models, samplers, checkpoints.

Each method takes a request body and returns ``(status, body, content_type)``. Operations that
compute are queued as :class:`~posttrain.serve.futures.Job` s and answer ``{request_id}`` at once;
one worker thread runs them (the models share one base network), the client fetches the outcome
with ``retrieve_future``. Errors the client can fix are ``{error, category: "user"}`` failures (or a
400 for a malformed request), never a silent approximation.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
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
from posttrain.serve.wire import decode_forward_backward, encode_forward_backward, encode_sample

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

Reply = tuple[int, bytes, str]
Snapshot = tuple[LoraSpec, Mapping[str, torch.Tensor]]

RETRIEVE_WAIT_S = 30.0
"""How long one ``retrieve_future`` waits for a result before answering ``try_again`` (the SDK polls again)."""

_SEQ_MEMORY = 65536

CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "sample_join_sampling_session": False, "custom_loss_server_side": False}
"""Feature flags for the SDK: API keys (no JWT exchange), plain httpx, no server-side custom losses."""


def reply(obj: object, status: int = 200) -> Reply:
    """A JSON reply."""
    return status, json.dumps(obj).encode(), JSON


def _json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body or b"{}")
    except json.JSONDecodeError as e:
        raise UserError(f"request body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise UserError("request body must be a JSON object")
    return obj


@dataclasses.dataclass
class _Sampler:
    """A sampling session: the base model (``key`` "base") or a snapshot's key (its tinker path or an id)."""

    base_model: str
    key: str
    model_path: str | None


class TinkerService:
    """State of one server: the model hub, the sampler, futures, sessions and snapshots."""

    def __init__(self, base_model: str, model: torch.nn.Module, tokenizer: Tokenizer | None, state_dir: Path,
                 *, snapshot_capacity: int = 16) -> None:
        self.base_model = base_model
        self.tokenizer = tokenizer
        self.state_dir = state_dir
        self.sampler = Sampler(model, tokenizer)  # copies the base before any adapter is added
        self.hub = ModelHub(base_model, model)
        self.futures = FutureTable()
        self.queue = JobQueue()
        self.sessions: dict[str, bool] = {}  # id -> finished
        self.declared: dict[str, LoraSpec] = {}  # model ids accepted (created or being created)
        self.samplers: dict[str, _Sampler] = {}
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
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
            jobs = self.queue.take(0.5)
            if not jobs:
                continue
            try:
                if len(jobs) > 1 and jobs[0].batch_work is not None:
                    outs = jobs[0].batch_work(jobs)
                else:
                    outs = [jobs[0].work()]
            except (UserError, ValueError) as e:
                outs = [failure(str(e), user=True)] * len(jobs)
            except Exception as e:  # noqa: BLE001  (the client gets a server-category failure; the traceback goes to stderr)
                traceback.print_exc(file=sys.stderr)
                outs = [failure(f"{type(e).__name__}: {e}", user=False)] * len(jobs)
            for j, o in zip(jobs, outs, strict=True):
                self.futures.resolve(j.request_id, o)

    def _submit(self, work: Callable[[], Outcome], *, order_key: str | None = None, seq: int | None = None,
                extra: Mapping[str, object] | None = None) -> Reply:
        """Queue ``work``; a request sent again with the same ``(order_key, seq)`` (the SDK's HTTP client
        retries after a lost reply) gets the first one's ``request_id`` instead of running twice."""
        with self._lock:
            rid = self._by_seq.get((order_key, seq)) if order_key is not None and seq is not None else None
            if rid is None:
                rid = str(uuid.uuid4())
                self.futures.add(rid)
                self.queue.submit(Job(rid, work, order_key, seq))
                if order_key is not None and seq is not None:
                    self._note_seq((order_key, seq), rid)
        return reply({"request_id": rid, **(extra or {})})

    def _note_seq(self, key: tuple[str, int], rid: str) -> None:
        self._by_seq[key] = rid
        while len(self._by_seq) > _SEQ_MEMORY:
            self._by_seq.popitem(last=False)

    # ------------------------------------------------------------------ session
    def client_config(self, body: bytes) -> Reply:
        """``POST /api/v1/client/config``: the feature flags."""
        return reply(CLIENT_CONFIG)

    def create_session(self, body: bytes) -> Reply:
        """``POST /api/v1/create_session``."""
        sid = str(uuid.uuid4())
        self.sessions[sid] = False
        return reply({"type": "create_session", "session_id": sid})

    def heartbeat(self, body: bytes) -> Reply:
        """``POST /api/v1/session_heartbeat`` (410 once the session finished: the SDK stops its loop)."""
        sid = str(_json(body).get("session_id"))
        if self.sessions.get(sid) is None:
            return reply({"detail": f"unknown session {sid!r}"}, 404)
        if self.sessions[sid]:
            return reply({"detail": f"session {sid!r} finished"}, 410)
        return reply({"type": "session_heartbeat"})

    def finish_session(self, sid: str) -> Reply:
        """``POST /api/v1/sessions/{id}/finish``."""
        if sid not in self.sessions:
            return reply({"detail": f"unknown session {sid!r}"}, 404)
        self.sessions[sid] = True
        return reply({})

    def capabilities(self, body: bytes) -> Reply:
        """``/api/v1/get_server_capabilities``: the one served model."""
        return reply({"supported_models": [{"model_name": self.base_model, "trainable": True, "sampleable": True,
                                            "max_context_length": self.sampler.context}]})

    # ------------------------------------------------------------------ training
    def _check_base(self, name: object) -> None:
        if name != self.base_model:
            raise UserError(f"base_model {name!r} is not served here (this server serves {self.base_model!r})")

    def create_model(self, body: bytes) -> Reply:
        """``POST /api/v1/create_model``: a LoRA training model ``<session>:train:<model_seq_id>``."""
        req = _json(body)
        self._check_base(req.get("base_model"))
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
        self.queue.open_order(model_id, 1)

        def work() -> Outcome:
            self.hub.create(model_id, spec)
            return Outcome(json.dumps({"model_id": model_id, "type": "create_model"}).encode())

        return self._submit(work, extra={"model_id": model_id})

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
        """``POST /api/v1/forward_backward`` (protobuf request and result; ``forward_only`` = ``/forward``)."""
        req = decode_forward_backward(body)
        mid = self._model({"model_id": req.model_id})

        def work() -> Outcome:
            res = self.hub.forward_backward(mid, req.data, req.loss_fn, req.loss_fn_config,
                                            forward_only=req.forward_only)
            return Outcome(encode_forward_backward(res.logprobs, {"loss:sum": res.loss_sum}), PROTOBUF)

        return self._submit(work, order_key=mid, seq=req.seq_id)

    def optim_step(self, body: bytes) -> Reply:
        """``POST /api/v1/optim_step`` (Adam parameters; other optimizers are refused)."""
        req = _json(body)
        mid = self._model(req)
        params = req.get("adam_params")
        if not isinstance(params, dict):
            raise UserError("optim_step: only Adam is supported (adam_params)")
        unknown = sorted(set(params) - {f.name for f in dataclasses.fields(AdamStep)})
        if unknown:
            raise UserError(f"optim_step: unknown adam_params {unknown}")
        step = AdamStep(**{k: float(v) for k, v in params.items()})

        def work() -> Outcome:
            return Outcome(json.dumps({"metrics": self.hub.optim_step(mid, step)}).encode())

        return self._submit(work, order_key=mid, seq=req.get("seq_id"))

    # ------------------------------------------------------------------ checkpoints
    def _remember(self, key: str, snap: Snapshot) -> None:
        self.snapshots[key] = snap
        self.snapshots.move_to_end(key)
        while len(self.snapshots) > self._capacity:
            self.snapshots.popitem(last=False)

    def _write(self, path: checkpoints.TinkerPath, mid: str, snap: Snapshot, optimizer: dict[str, Any] | None) -> None:
        self.sampler.load(path.uri, lambda: self.hub.merged(snap))
        checkpoints.write(path, self.state_dir, step=self.hub.get(mid).steps, actor=self.sampler.model,
                          tokenizer=self.tokenizer,
                          saved=checkpoints.Saved(self.base_model, snap[0], dict(snap[1]), optimizer))

    def save_weights(self, body: bytes) -> Reply:
        """``POST /api/v1/save_weights`` (``save_state``): adapter + optimizer to ``tinker://<model>/weights/<name>``."""
        req = _json(body)
        mid = self._model(req)
        path = checkpoints.parse_path(f"tinker://{mid}/weights/{req.get('path') or uuid.uuid4().hex[:8]}")

        def work() -> Outcome:
            snap = (self.declared[mid], self.hub.adapter_state(mid))
            self._write(path, mid, snap, self.hub.get(mid).optimizer.state_dict())
            return Outcome(json.dumps({"path": path.uri, "type": "save_weights"}).encode())

        return self._submit(work, order_key=mid, seq=req.get("seq_id"))

    def save_for_sampler(self, body: bytes) -> Reply:
        """``POST /api/v1/save_weights_for_sampler``: a named checkpoint (``path``), or, without a name, a
        sampling session on an in-memory snapshot (``sampling_session_id``)."""
        req = _json(body)
        mid = self._model(req)
        name = req.get("path")
        if name is None and req.get("sampling_session_seq_id") is None:
            raise UserError("save_weights_for_sampler: give a path or a sampling_session_seq_id")

        def work() -> Outcome:
            snap: Snapshot = (self.declared[mid], self.hub.adapter_state(mid))
            if name is not None:
                path = checkpoints.parse_path(f"tinker://{mid}/sampler_weights/{name}")
                self._write(path, mid, snap, None)
                self._remember(path.uri, snap)
                return Outcome(json.dumps({"path": path.uri, "type": "save_weights_for_sampler"}).encode())
            sid = f"{mid.split(':')[0]}:sample:{int(req['sampling_session_seq_id'])}"
            self._remember(sid, snap)
            self.samplers[sid] = _Sampler(self.base_model, sid, None)
            return Outcome(json.dumps({"sampling_session_id": sid, "type": "save_weights_for_sampler"}).encode())

        return self._submit(work, order_key=mid, seq=req.get("seq_id"))

    def load_weights(self, body: bytes) -> Reply:
        """``POST /api/v1/load_weights``: into an existing model (``model_id`` + ``seq_id``) or creating one
        (``session_id`` + ``model_seq_id``); with or without the optimizer state."""
        req = _json(body)
        path = checkpoints.parse_path(str(req.get("path")))
        with_opt = bool(req.get("optimizer"))
        if req.get("session_id") is not None:
            mid = f"{req['session_id']}:train:{int(req['model_seq_id'])}"
            saved = checkpoints.read(path, self.state_dir)
            self._check_base(req.get("base_model") or saved.base_model)
            if mid in self.declared:
                raise UserError(f"model {mid!r} exists already")
            self.declared[mid] = saved.lora
            self.queue.open_order(mid, 1)
            order: tuple[str | None, int | None] = (None, None)
        else:
            mid = self._model(req)
            order = (mid, req.get("seq_id"))

        def work() -> Outcome:
            saved = checkpoints.read(path, self.state_dir)
            if mid not in self.hub.models:
                self.hub.create(mid, saved.lora)
            if saved.lora != self.declared[mid]:
                raise UserError(f"{path.uri}: LoRA config {saved.lora} differs from model {mid!r}'s {self.declared[mid]}")
            self.hub.load_adapter_state(mid, saved.adapter)
            if with_opt:
                if saved.optimizer is None:
                    raise UserError(f"{path.uri} holds no optimizer state (a sampler checkpoint)")
                self.hub.get(mid).optimizer.load_state_dict(saved.optimizer)
            return Outcome(json.dumps({"path": path.uri, "model_id": mid, "type": "load_weights"}).encode())

        return self._submit(work, order_key=order[0], seq=order[1], extra={"model_id": mid})

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, body: bytes) -> Reply:
        """``POST /api/v1/create_sampling_session`` on a ``tinker://`` path or the base model."""
        req = _json(body)
        sid = f"{req['session_id']}:sample:{int(req['sampling_session_seq_id'])}"
        mp = req.get("model_path")
        if mp is not None:
            path = checkpoints.parse_path(str(mp))
            if path.kind != "sampler_weights" and path.kind != "weights":
                raise UserError(f"cannot sample from {mp!r}")
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
        """``POST /api/v1/asample``: sample from a sampling session (or a ``model_path`` / ``base_model``)."""
        req = _json(body)
        sid = req.get("sampling_session_id")
        if sid is not None:
            s = self.samplers.get(str(sid))
            if s is None:
                raise UserError(f"unknown sampling_session_id {sid!r}")
            key = s.key
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
                call = sample_call(rid, req, prompt, self.sampler.context)
                self.futures.add(rid)
                job = Job(rid, lambda: self._sample_batch([job])[0], batch_key=key, batch_work=self._sample_batch,
                          payload=call)
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
