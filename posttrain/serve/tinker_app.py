"""HTTP routes of the Tinker API (``/api/v1/...``) on the standard library's threading HTTP server,
bound to 127.0.0.1 by default. Each route calls one :class:`~posttrain.serve.tinker_service.TinkerService`
method; a :class:`~posttrain.errors.UserError` (or ``ValueError``) in a request is a 400 with
``{detail}``, and any route this server does not serve, whatever the method (GET, POST, PUT, DELETE,
PATCH), a 404 naming it: the SDK retries 408, 409, 429 and 5xx and treats every other status as final, so
neither ever leaves a client retrying (the standard library's own answer to an unhandled method, an
HTML 501, was retried for ever).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import traceback
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from posttrain.errors import UserError
from posttrain.serve.tinker_service import (
    MAX_DATUM_TOKENS,
    REFUSALS,
    Reply,
    TinkerService,
    refusal_message,
    reply,
    return_large_blocks,
)

_BODY_LIMIT = 256 * 1024 * 1024


def _routes(svc: TinkerService) -> dict[str, Callable[[bytes], Reply]]:
    """The POST routes with a fixed path (GET for ``healthz`` and ``get_server_capabilities`` too)."""
    return {
        "/api/v1/client/config": svc.client_config,
        "/api/v1/client/dynamic_config": svc.dynamic_config,
        "/api/v1/create_session": svc.create_session,
        "/api/v1/session_heartbeat": svc.heartbeat,
        "/api/v1/telemetry": lambda body: reply({"status": "accepted"}),
        "/api/v1/healthz": lambda body: reply({"status": "ok"}),
        "/api/v1/get_server_capabilities": svc.capabilities,
        "/api/v1/create_model": svc.create_model,
        "/api/v1/get_info": svc.get_info,
        "/api/v1/forward_backward": svc.forward_backward,
        "/api/v1/optim_step": svc.optim_step,
        "/api/v1/save_weights": svc.save_weights,
        "/api/v1/save_weights_for_sampler": svc.save_for_sampler,
        "/api/v1/save_weights_external": svc.save_weights_external,
        "/api/v1/weights_info": svc.weights_info,
        "/api/v1/load_weights": svc.load_weights,
        "/api/v1/create_sampling_session": svc.create_sampling_session,
        "/api/v1/asample": svc.asample,
        "/api/v1/retrieve_future": svc.retrieve,
        "/api/v1/cancel_future": svc.cancel_future,
    }


_RestHandler = Callable[[tuple[str, ...], Mapping[str, str], bytes], Reply]
_RUN = "/api/v1/training_runs/([^/]+)"
_CKPT = _RUN + "/checkpoints/((?:weights|sampler_weights)/[^/]+)"


def _rest(svc: TinkerService) -> list[tuple[str, re.Pattern[str], _RestHandler]]:
    """The routes with ids in the path or query parameters: ``(method, path pattern, handler(groups, query, body))``."""
    return [
        ("POST", re.compile(r"^/api/v1/sessions/([^/]+)/finish$"), lambda g, q, b: svc.finish_session(g[0])),
        ("GET", re.compile(r"^/api/v1/samplers/([^/]+)$"), lambda g, q, b: svc.get_sampler(g[0])),
        ("GET", re.compile(r"^/api/v1/sessions$"), lambda g, q, b: svc.list_sessions(q)),
        ("GET", re.compile(r"^/api/v1/sessions/([^/]+)$"), lambda g, q, b: svc.get_session(g[0])),
        ("GET", re.compile(r"^/api/v1/training_runs$"), lambda g, q, b: svc.list_training_runs(q)),
        ("GET", re.compile(f"^{_RUN}$"), lambda g, q, b: svc.get_training_run(g[0])),
        ("GET", re.compile(f"^{_RUN}/checkpoints$"), lambda g, q, b: svc.list_checkpoints(g[0])),
        ("DELETE", re.compile(f"^{_CKPT}$"), lambda g, q, b: svc.delete_checkpoint(g[0], g[1])),
        ("PUT", re.compile(f"^{_CKPT}/ttl$"), lambda g, q, b: svc.set_checkpoint_ttl(g[0], g[1], b)),
        ("GET", re.compile(r"^/api/v1/checkpoints$"), lambda g, q, b: svc.list_user_checkpoints(q)),
    ]


class TinkerServer(ThreadingHTTPServer):
    """The HTTP server and its service; :meth:`start` serves on a thread, :meth:`close` stops both."""

    daemon_threads = True
    # The SDK opens many connections at once (parallel polls, up to 50 requests per client) with a 5 s
    # connect timeout: a backlog of socketserver's default 5 drops connects under load, and the client
    # then re-sends requests (answered once, see TinkerService._submit).
    request_queue_size = 256

    def __init__(self, service: TinkerService, host: str, port: int) -> None:
        self.service = service
        self.routes = _routes(service)
        self.rest = _rest(service)
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        """``http://host:port``."""
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that drops its connection (the SDK closing pooled connections) is not an error to print."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]

    def dispatch(self, method: str, target: str, body: bytes) -> Reply:
        """The reply to one request (``target``: the path and query string)."""
        path, _, qs = target.partition("?")
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(qs).items()}
        try:
            for m_, pattern, handler in self.rest:
                if m_ == method and (m := pattern.match(path)):
                    return handler(tuple(urllib.parse.unquote(x) for x in m.groups()), query, body)
            fn = self.routes.get(path)
            if fn is None or method not in ("POST", "GET"):
                return reply({"detail": f"{method} {path} is not implemented by posttrain serve"}, 404)
            return fn(body)
        except REFUSALS as e:
            return reply({"detail": refusal_message(e)}, 400)

    def start(self) -> None:
        """Serve on a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and the service's worker."""
        self.shutdown()
        self.server_close()
        self.service.close()
        if self._thread is not None:
            self._thread.join(10)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: TinkerServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (the stdlib's name)
        """Quiet: no line per request."""

    def _handle(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if n > _BODY_LIMIT:
            status, body, ctype = reply({"detail": f"request body over {_BODY_LIMIT} bytes"}, 413)
        else:
            data = self.rfile.read(n) if n else b""
            if self.headers.get("Content-Encoding", "identity") != "identity":
                status, body, ctype = reply({"detail": "compressed request bodies are not supported"}, 400)
            else:
                try:
                    status, body, ctype = self.server.dispatch(method, self.path, data)
                except Exception as e:  # noqa: BLE001  (a bug is a 500 naming it; the traceback goes to stderr)
                    traceback.print_exc(file=sys.stderr)
                    status, body, ctype = 500, json.dumps({"detail": f"{type(e).__name__}: {e}"}).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802  (the stdlib's name)
        """Any POST route."""
        self._handle("POST")

    def do_GET(self) -> None:  # noqa: N802
        """GET routes (samplers, sessions, training runs, checkpoints, healthz)."""
        self._handle("GET")

    def do_PUT(self) -> None:  # noqa: N802
        """PUT routes (checkpoint TTL)."""
        self._handle("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        """DELETE routes (checkpoints)."""
        self._handle("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        """No PATCH route: a 404 naming it."""
        self._handle("PATCH")


def load_base(model: str) -> tuple[object, object]:
    """``(tokenizer, model)`` for ``builtin:<name>`` or a local Hugging Face directory (float32)."""
    from posttrain.config import RunConfig
    from posttrain.loop.builders import build_model

    if not model.startswith("builtin:") and not Path(model).is_dir():
        raise UserError(f"--model {model!r}: not a builtin: name or a model directory")
    return build_model(RunConfig.model_validate({"model": {"path": model}}))


def make_server(model: str, *, port: int = 0, host: str = "127.0.0.1", state_dir: str | Path = "runs/tinker",
                max_datum_tokens: int = MAX_DATUM_TOKENS) -> TinkerServer:
    """A Tinker API server on ``host:port`` (0: a free port) training LoRA adapters on ``model``;
    checkpoints go under ``state_dir``; a ``forward_backward`` datum of more than ``max_datum_tokens`` tokens
    is refused. Sets this process's heap to return large blocks (:func:`return_large_blocks`). Call
    ``start()`` (or ``serve_forever()``) and ``close()``."""
    return_large_blocks()
    tokenizer, net = load_base(model)
    svc = TinkerService(model, net, tokenizer, Path(state_dir), max_datum_tokens=max_datum_tokens)  # type: ignore[arg-type]
    try:
        return TinkerServer(svc, host, port)
    except OSError:
        svc.close()
        raise
