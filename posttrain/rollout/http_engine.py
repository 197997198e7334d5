"""A rollout engine in its own process behind a small HTTP interface (stdlib only).

Why: an inference stack (vLLM and its pinned torch/CUDA) can live in its own environment and
process; the learner's process talks to it through :class:`HTTPEngine`, which implements the
:class:`~posttrain.rollout.engine.RolloutEngine` protocol, so the loop cannot tell the difference.

Server (``python -m posttrain.rollout.http_engine --factory module:callable [--kwargs JSON]``):
builds the engine with ``callable(**kwargs)``, binds ``--host`` (127.0.0.1 by default; any other
address needs ``--allow-remote``), port ``--port`` (0: a free one), prints ``LISTENING <port>`` on
stdout, and serves until SIGTERM/SIGINT, ``POST /shutdown`` or (``--exit-on-stdin-eof``, used by
:class:`~posttrain.rollout.server_process.SpawnedEngine`) the end of its stdin. A threading server, so ``/pause``
is answered while a ``/generate`` runs.

=====================  =======================================================================
``GET /health``        ``{"ok": true, "version": v}``
``GET /version``       ``{"version": v}``
``POST /generate``     JSON ``{"requests": [...], "finish_target": k|null}`` ->
                       ``{"completions": [...]}``; a bad request (``ValueError``) -> 400
``POST /update_weights`` body = 8-byte big-endian header length + header JSON + raw tensor bytes
                       (a :class:`~posttrain.rollout.weight_transfer.WeightPacket`); headers
                       ``X-Weights-Version`` / ``X-Weights-Checksum`` announce what the payload
                       must verify to -> ``{"version": v, "checksum": c}``; a mismatch -> 409
``POST /pause``        ``{}``
``POST /sleep``        the engine's colocation hook -> ``{"reason": null}`` when it released its
                       memory, else ``{"reason": "..."}`` (no hook, or why it cannot here)
``POST /wake``         re-acquire after a ``/sleep`` that released -> ``{}``
``POST /shutdown``     ``{}`` then the server stops
=====================  =======================================================================

Errors come back as ``{"error": "..."}`` with a 4xx/5xx status; the client raises them as
``ValueError`` (400), :class:`WeightTransferError` (409) or ``RuntimeError``. Every client call
has a timeout (``timeout_s``); nothing waits unbounded.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import signal
import struct
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

import torch

from posttrain.dotted import import_dotted
from posttrain.rollout.engine import RolloutEngine, engine_sleep, engine_wake
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.rollout.weight_transfer import WeightPacket, WeightTransferError, pack_state_dict

LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_JSON_BYTES = 256 * 2**20


# ---------------------------------------------------------------------------- JSON codec
def _finite_or_str(x: float) -> float | str:
    return x if math.isfinite(x) else ("-inf" if x < 0 else ("inf" if x > 0 else "nan"))


def completion_to_json(c: Completion) -> dict[str, Any]:
    """A JSON-able dict holding every field of ``c`` (floats round-trip exactly through ``repr``)."""
    full = None
    if c.full_logprobs is not None:
        full = [[_finite_or_str(float(v)) for v in row] for row in c.full_logprobs.tolist()]
    return {
        "request_id": c.request_id,
        "sample_index": c.sample_index,
        "prompt_ids": list(c.prompt_ids),
        "token_ids": list(c.token_ids),
        "logprobs": [_finite_or_str(float(x)) for x in c.logprobs],
        "versions": list(c.versions),
        "finish_reason": c.finish_reason,
        "full_logprobs": full,
        "params": c.params.to_record() if c.params is not None else None,
        "seed": c.seed,
    }


def completion_from_json(d: Mapping[str, Any]) -> Completion:
    """Inverse of :func:`completion_to_json`."""
    full = d.get("full_logprobs")
    return Completion(
        request_id=str(d["request_id"]),
        sample_index=int(d["sample_index"]),
        prompt_ids=[int(t) for t in d["prompt_ids"]],
        token_ids=[int(t) for t in d["token_ids"]],
        logprobs=[float(x) for x in d["logprobs"]],
        versions=[int(v) for v in d["versions"]],
        finish_reason=str(d["finish_reason"]),
        full_logprobs=None if full is None else torch.tensor([[float(v) for v in r] for r in full], dtype=torch.float64),
        params=SamplingParams.from_record(d["params"]) if d.get("params") is not None else None,
        seed=None if d.get("seed") is None else int(d["seed"]),
    )


def request_to_json(r: GenerationRequest) -> dict[str, Any]:
    """A JSON-able dict of a request (its resume completion included)."""
    return {
        "request_id": r.request_id,
        "prompt_ids": [int(t) for t in r.prompt_ids],
        "params": r.params.to_record(),
        "resume": completion_to_json(r.resume) if r.resume is not None else None,
    }


def request_from_json(d: Mapping[str, Any]) -> GenerationRequest:
    """Inverse of :func:`request_to_json`."""
    return GenerationRequest(
        request_id=str(d["request_id"]),
        prompt_ids=[int(t) for t in d["prompt_ids"]],
        params=SamplingParams.from_record(d["params"]),
        resume=completion_from_json(d["resume"]) if d.get("resume") is not None else None,
    )


def encode_packet(packet: WeightPacket) -> bytes:
    """``len(header) (8 bytes, big-endian) + header JSON + buffer``."""
    header = json.dumps(packet.header()).encode()
    return struct.pack(">Q", len(header)) + header + packet.buffer.tobytes()


def decode_packet(body: bytes) -> WeightPacket:
    """Inverse of :func:`encode_packet` (no verification)."""
    if len(body) < 8:
        raise WeightTransferError("weight payload shorter than its 8-byte header length")
    (n,) = struct.unpack(">Q", body[:8])
    if 8 + n > len(body):
        raise WeightTransferError(f"weight payload truncated inside its header ({len(body)} bytes, header {n})")
    header = json.loads(body[8 : 8 + n])
    return WeightPacket.from_wire(header, memoryview(body)[8 + n :])


# ---------------------------------------------------------------------------- server
class _Handler(BaseHTTPRequestHandler):
    server: EngineHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, payload: Mapping[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self, limit: int) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n > limit:
            raise ValueError(f"request body of {n} bytes exceeds the limit of {limit}")
        return self.rfile.read(n) if n else b""

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        eng = self.server.engine
        if self.path == "/health":
            self._send(200, {"ok": True, "version": int(eng.version)})
        elif self.path == "/version":
            self._send(200, {"version": int(eng.version)})
        else:
            self._send(404, {"error": f"no route GET {self.path}"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        eng = self.server.engine
        try:
            if self.path == "/generate":
                d = json.loads(self._body(MAX_JSON_BYTES) or b"{}")
                reqs = [request_from_json(r) for r in d.get("requests", [])]
                out = eng.generate(reqs, finish_target=d.get("finish_target"))
                self._send(200, {"completions": [completion_to_json(c) for c in out]})
            elif self.path == "/update_weights":
                version = int(self.headers["X-Weights-Version"])
                checksum = str(self.headers["X-Weights-Checksum"])
                packet = decode_packet(self._body(self.server.max_weight_bytes))
                packet.verify(version=version, checksum=checksum, where="http engine")
                if version < int(eng.version):
                    raise WeightTransferError(f"http engine: refusing weights v{version}, engine holds v{eng.version}")
                eng.update_weights(packet.tensors(), version)
                self._send(200, {"version": int(eng.version), "checksum": checksum})
            elif self.path == "/pause":
                eng.pause()
                self._send(200, {})
            elif self.path == "/sleep":
                self._send(200, {"reason": engine_sleep(eng)})
            elif self.path == "/wake":
                engine_wake(eng)
                self._send(200, {})
            elif self.path == "/shutdown":
                self._send(200, {})
                threading.Thread(target=self.server.shutdown, daemon=True).start()
            else:
                self._send(404, {"error": f"no route POST {self.path}"})
        except WeightTransferError as e:
            self._send(409, {"error": str(e)})
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            self._send(400, {"error": f"{type(e).__name__}: {e}"})
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500, never swallowed
            self._send(500, {"error": f"{type(e).__name__}: {e}"})


class EngineHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server holding one engine (see the module docstring)."""

    daemon_threads = True

    def __init__(self, engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0, *,
                 allow_remote: bool = False, max_weight_bytes: int = 64 * 2**30, verbose: bool = False) -> None:
        if host not in LOOPBACK and not allow_remote:
            raise ValueError(f"refusing to bind {host!r}: only loopback ({', '.join(LOOPBACK)}) unless allow_remote=True")
        self.engine = engine
        self.max_weight_bytes = max_weight_bytes
        self.verbose = verbose
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.server_address[1])


def load_factory(spec: str) -> Callable[..., RolloutEngine]:
    """``"package.module:callable"`` -> the callable (an engine factory: its result is served as one)."""
    factory: Callable[..., RolloutEngine] = import_dotted(spec, what="--factory", shape="module:callable")
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry of the server (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m posttrain.rollout.http_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--factory", required=True, help="module:callable returning a RolloutEngine")
    ap.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the factory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--exit-on-stdin-eof", action="store_true",
                    help="stop when stdin closes (the parent that started this server died or let go)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    engine = load_factory(a.factory)(**json.loads(a.kwargs))
    server = EngineHTTPServer(engine, a.host, a.port, allow_remote=a.allow_remote, verbose=a.verbose)

    def stop(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if a.exit_on_stdin_eof:
        # A parent that owns this server holds our stdin open; its exit (even a SIGKILL) closes it.
        def watch_stdin() -> None:
            while sys.stdin.buffer.read(65536):
                pass
            server.shutdown()

        threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    print(f"LISTENING {server.port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


# ---------------------------------------------------------------------------- client
class HTTPEngine:
    """Client side: a :class:`RolloutEngine` whose engine runs behind ``base_url``.

    Every call opens its own connection with ``timeout_s`` (so ``pause()`` from another thread
    works while ``generate`` waits) and raises on a non-2xx answer: ``ValueError`` (400, a bad
    request), :class:`WeightTransferError` (409, a weight payload that failed verification),
    ``RuntimeError`` otherwise; a timeout raises ``TimeoutError`` naming the URL.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, weights_timeout_s: float = 600.0) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"base_url must be http://host:port, got {base_url!r}")
        self.base_url, self.host, self.port = base_url.rstrip("/"), u.hostname, u.port
        self.timeout_s, self.weights_timeout_s = timeout_s, weights_timeout_s
        self._version: int | None = None  # the server's version as last confirmed to this client
        self._updates = 0  # weight updates confirmed (a /version answer older than one is not cached)
        self._version_lock = threading.Lock()

    def _call(self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
              timeout_s: float | None = None) -> dict[str, Any]:
        t = self.timeout_s if timeout_s is None else timeout_s
        conn = http.client.HTTPConnection(self.host, self.port, timeout=t)
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            resp = conn.getresponse()
            data = resp.read()
        except TimeoutError as e:
            raise TimeoutError(f"{method} {self.base_url}{path}: no answer within {t:g}s") from e
        except OSError as e:
            raise ConnectionError(f"{method} {self.base_url}{path}: {e}") from e
        finally:
            conn.close()
        payload: dict[str, Any] = json.loads(data) if data else {}
        if resp.status == 400:
            raise ValueError(f"{self.base_url}{path}: {payload.get('error')}")
        if resp.status == 409:
            raise WeightTransferError(f"{self.base_url}{path}: {payload.get('error')}")
        if resp.status >= 300:
            raise RuntimeError(f"{self.base_url}{path}: HTTP {resp.status}: {payload.get('error')}")
        return payload

    @property
    def version(self) -> int:
        """The server engine's version: asked over HTTP once, then the version the server confirmed for
        this client's last weight update. Only weight updates change it, and one client drives a server
        (the trainer that started or connected to it), so the loop's admission checks, which read it
        every few milliseconds, cost no round trip."""
        v = self._version
        if v is None:
            with self._version_lock:
                seen = self._updates
            v = int(self._call("GET", "/version")["version"])
            with self._version_lock:
                if self._updates == seen:  # no update of ours landed while we asked: v is current
                    self._version = v
        return v

    def health(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """``GET /health``."""
        return self._call("GET", "/health", timeout_s=timeout_s)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Poll ``/health`` until it answers; ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self.health(timeout_s=2.0)
                return
            except (ConnectionError, TimeoutError, RuntimeError) as e:
                last = e
                time.sleep(0.1)
        raise TimeoutError(f"{self.base_url} not healthy within {timeout_s:g}s ({last})")

    def generate(self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None) -> list[Completion]:
        """``POST /generate``; completions in the engine's order."""
        body = json.dumps({"requests": [request_to_json(r) for r in requests], "finish_target": finish_target})
        out = self._call("POST", "/generate", body.encode(), {"Content-Type": "application/json"})
        return [completion_from_json(c) for c in out["completions"]]

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Pack, send, and check that the server verified exactly what was sent."""
        v = self.version + 1 if version is None else int(version)
        packet = pack_state_dict(state_dict, v)
        self.send_packet(packet)

    def send_packet(self, packet: WeightPacket) -> dict[str, float]:
        """``POST /update_weights`` of an already packed state dict; returns ``{"transfer_s", "bytes"}``."""
        t0 = time.perf_counter()
        try:
            out = self._call(
                "POST", "/update_weights", encode_packet(packet),
                {"Content-Type": "application/octet-stream", "X-Weights-Version": str(packet.version),
                 "X-Weights-Checksum": packet.checksum},
                timeout_s=self.weights_timeout_s,
            )
        except (TimeoutError, ConnectionError, RuntimeError):  # the server may or may not have applied it
            with self._version_lock:
                self._version = None
            raise
        with self._version_lock:
            self._updates += 1
            self._version = int(out["version"]) if int(out["version"]) == packet.version else None
        if int(out["version"]) != packet.version or out["checksum"] != packet.checksum:
            raise WeightTransferError(f"{self.base_url}: server confirmed v{out['version']} {out['checksum']}, "
                                      f"sent v{packet.version} {packet.checksum}")
        return {"transfer_s": time.perf_counter() - t0, "bytes": float(packet.nbytes)}

    def pause(self) -> None:
        """``POST /pause`` (bounded by 10 s)."""
        self._call("POST", "/pause", b"", timeout_s=10.0)

    def sleep(self) -> str | None:
        """``POST /sleep``: the server engine's colocation hook; None when it released its memory, else
        the server's reason (:func:`~posttrain.rollout.engine.engine_sleep`)."""
        reason = self._call("POST", "/sleep", b"")["reason"]
        return None if reason is None else str(reason)

    def wake(self) -> None:
        """``POST /wake`` (after a :meth:`sleep` that returned None)."""
        self._call("POST", "/wake", b"")

    def shutdown(self) -> None:
        """``POST /shutdown`` (bounded by 10 s)."""
        self._call("POST", "/shutdown", b"", timeout_s=10.0)


def tiny_builtin_engine(preset: str = "micro", seed: int = 0, vocab_size: int = 106, dtype: str = "float32",
                        max_batch_size: int | None = None) -> RolloutEngine:
    """Factory for the server: a :class:`BuiltinEngine` on a tiny Qwen2 model (tests, demos)."""
    from posttrain.models import build_tiny_model
    from posttrain.rollout.builtin import BuiltinEngine

    model = build_tiny_model(preset, vocab_size, seed=seed, dtype=getattr(torch, dtype))
    return BuiltinEngine(model, eos_token_id=1, max_batch_size=max_batch_size)


if __name__ == "__main__":
    sys.exit(main())
