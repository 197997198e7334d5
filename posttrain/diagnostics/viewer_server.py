"""The local HTTP server of ``posttrain view``: the page plus JSON endpoints, bound to 127.0.0.1.

Endpoints (all GET): ``/`` the page; ``/api/steps``; ``/api/step?step=N&status=..&lag_min=..``
(filters of :class:`~posttrain.diagnostics.viewer_data.Filters`); ``/api/traj?step=N&id=ID``;
``/api/flagged``. Errors are JSON ``{"error": "..."}`` with status 400 (bad query) or 404.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from posttrain.diagnostics.second_verifier import disagreements
from posttrain.diagnostics.token_text import load_decoder
from posttrain.diagnostics.viewer_data import Filters, list_steps, passed_rows, step_groups, trajectory_detail
from posttrain.diagnostics.viewer_page import PAGE

# Loopback only: the ledger holds prompts and responses, which are not for the network.
HOST = "127.0.0.1"


def make_server(run_dir: str | Path, port: int = 0, verifier: Any | None = None) -> ThreadingHTTPServer:
    """A server for ``run_dir`` on ``127.0.0.1:port`` (0 picks a free port); call ``serve_forever``."""
    run = Path(run_dir)
    decode, token_source = load_decoder(run)

    class Handler(BaseHTTPRequestHandler):
        """Answers the page and the JSON endpoints of the module docstring for ``run``."""

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            """Silenced: one line per request would drown the terminal."""

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")  # the run may still be writing
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, doc: Any) -> None:
            self._send(code, json.dumps(doc).encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            """Route by path; user errors become JSON 400/404, never a traceback page."""
            url = urlparse(self.path)
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                if url.path in ("/", "/index.html"):
                    self._send(200, PAGE.encode(), "text/html; charset=utf-8")
                elif url.path == "/api/steps":
                    self._json(200, {"run_dir": str(run), "tokens": token_source, "steps": list_steps(run)})
                elif url.path == "/api/step":
                    self._json(200, step_groups(run, _int(q, "step"), Filters.from_query(q)))
                elif url.path == "/api/traj":
                    self._json(200, trajectory_detail(run, _int(q, "step"), q.get("id", ""), decode))
                elif url.path == "/api/flagged":
                    self._json(200, disagreements(passed_rows(run), verifier))
                else:
                    self._json(404, {"error": f"no such page {url.path}"})
            except ValueError as e:
                self._json(400, {"error": str(e)})
            except (KeyError, FileNotFoundError) as e:
                self._json(404, {"error": str(e.args[0] if e.args else e)})

    return ThreadingHTTPServer((HOST, port), Handler)


def _int(q: dict[str, str], name: str) -> int:
    try:
        return int(q[name])
    except KeyError:
        raise ValueError(f"missing query parameter {name}") from None
    except ValueError:
        raise ValueError(f"query parameter {name}={q[name]!r} is not an integer") from None
