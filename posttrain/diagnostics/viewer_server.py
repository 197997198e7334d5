"""The local HTTP servers of ``posttrain view``: pages plus JSON endpoints, bound to 127.0.0.1.

:func:`make_dashboard` (what ``posttrain view DIR`` serves), all GET:

- ``/`` the runs page; ``/api/runs`` every run below DIR with its status and last held-out figure;
- ``/run/<id>/`` a run's page (``<id>``: the run's path relative to DIR, URL-quoted; ``@`` is DIR itself);
  ``/run/<id>/api/curves?after=STEP&gen=G&keys=K1,K2[&full=1]`` the curves
  (:meth:`~posttrain.diagnostics.dashboard_data.RunData.curves`: without ``after``, or with a stale
  ``gen``, all points; else only the steps after ``after``), ``/run/<id>/api/symptoms``,
  ``/run/<id>/api/checkpoints``, ``/run/<id>/api/config``;
- ``/run/<id>/traj/`` the run's trajectory viewer (``?step=N`` opens step N) with its endpoints
  under ``/run/<id>/traj/api/``;
- ``/compare/?runs=ID,ID`` two or more runs overlaid, with ``/api/compare?runs=ID,ID[&set=heldout]``
  (:func:`~posttrain.diagnostics.dashboard_compare.compare_doc`: held-out accuracy at an equal
  generated-token budget and the paired bootstrap interval of each difference with the first run);
- ``/static/plotly.min.js``: plotly.js from the installed ``plotly`` wheel (no CDN, no network).

:func:`make_server` serves one run's trajectory viewer at ``/``: ``/api/steps``;
``/api/step?step=N&status=..&lag_min=..&offset=K&limit=L`` (filters of
:class:`~posttrain.diagnostics.viewer_data.Filters`, applied before paging; at most ``limit`` groups, default
50, from group ``offset``, with ``groups_total`` and ``next_offset``);
``/api/traj?step=N&id=ID``; ``/api/flagged``. Errors are JSON ``{"error": "..."}`` with status 400
(bad query), 404 (no such run, step or trajectory) or 500 (one line, never a traceback page).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlparse

from posttrain.diagnostics.dashboard_compare import compare_doc
from posttrain.diagnostics.dashboard_data import RunData
from posttrain.diagnostics.dashboard_page import COMPARE_PAGE, RUN_PAGE, RUNS_PAGE
from posttrain.diagnostics.runs import find_runs, run_id
from posttrain.diagnostics.second_verifier import disagreements
from posttrain.diagnostics.token_text import Decoder, load_decoder
from posttrain.diagnostics.viewer_data import (
    DEFAULT_PAGE,
    MAX_PAGE,
    Filters,
    list_steps,
    passed_rows,
    step_groups,
    trajectory_detail,
)
from posttrain.diagnostics.viewer_page import PAGE

# Loopback only: the ledger holds prompts and responses, which are not for the network.
HOST = "127.0.0.1"
PLOT_EXTRA = "pip install 'posttrain[plot]'"


def plotly_js() -> Path | None:
    """``plotly.min.js`` of the installed ``plotly`` wheel, or None when plotly is not installed."""
    try:
        import plotly
    except ImportError:
        return None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


class _Reply(Exception):
    """A finished answer raised out of the routing: status, body and content type."""

    def __init__(self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(code)
        self.code, self.body, self.ctype, self.headers = code, body, ctype, headers or {}


def _json(code: int, doc: Any) -> _Reply:
    return _Reply(code, json.dumps(doc).encode(), "application/json")


def _html(page: str) -> _Reply:
    return _Reply(200, page.encode(), "text/html; charset=utf-8")


def _trajectory_api(run: Path, sub: str, q: dict[str, str], decoder: Callable[[], tuple[Decoder, str]],
                    verifier: Any | None) -> _Reply:
    """The trajectory viewer's endpoints (``sub``: the path after its root, e.g. ``api/steps``)."""
    if sub == "api/steps":
        return _json(200, {"run_dir": str(run), "tokens": decoder()[1], "steps": list_steps(run)})
    if sub == "api/step":
        limit = _int(q, "limit") if q.get("limit", "").strip() else DEFAULT_PAGE
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"query parameter limit={limit} must be 1..{MAX_PAGE}")
        offset = _int(q, "offset") if q.get("offset", "").strip() else 0
        return _json(200, step_groups(run, _int(q, "step"), Filters.from_query(q), offset, limit))
    if sub == "api/traj":
        return _json(200, trajectory_detail(run, _int(q, "step"), q.get("id", ""), decoder()[0]))
    if sub == "api/flagged":
        return _json(200, disagreements(passed_rows(run), verifier))
    raise _json(404, {"error": f"no such page /{sub}"})


def _handler(route: Callable[[str, dict[str, str]], _Reply]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """Answers GET requests through ``route``; user errors become JSON 400/404, others a one-line 500."""

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            """Silenced: one line per request would drown the terminal."""

        def _send(self, r: _Reply) -> None:
            self.send_response(r.code)
            self.send_header("Content-Type", r.ctype)
            self.send_header("Content-Length", str(len(r.body)))
            # no-store by default: the run may be writing
            self.send_header("Cache-Control", r.headers.pop("Cache-Control", "no-store"))
            for k, v in r.headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(r.body)

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            """Route by path; never a traceback page."""
            url = urlparse(self.path)
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                if url.path == "/favicon.ico":
                    reply = _Reply(204, b"", "image/x-icon", {"Cache-Control": "max-age=86400"})
                else:
                    reply = route(url.path, q)
            except _Reply as r:
                reply = r
            except ValueError as e:
                reply = _json(400, {"error": str(e)})
            except (KeyError, FileNotFoundError) as e:
                reply = _json(404, {"error": str(e.args[0] if e.args else e)})
            except Exception as e:  # noqa: BLE001 - a bug in one request must not take the page down
                reply = _json(500, {"error": f"{type(e).__name__}: {e}".splitlines()[0]})
            try:
                self._send(reply)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the page went away mid-answer

    return Handler


def make_server(run_dir: str | Path, port: int = 0, verifier: Any | None = None) -> ThreadingHTTPServer:
    """One run's trajectory viewer on ``127.0.0.1:port`` (0 picks a free port); call ``serve_forever``."""
    run = Path(run_dir)
    decoded = load_decoder(run)

    def route(path: str, q: dict[str, str]) -> _Reply:
        if path in ("/", "/index.html"):
            return _html(PAGE)
        return _trajectory_api(run, path.lstrip("/"), q, lambda: decoded, verifier)

    return ThreadingHTTPServer((HOST, port), _handler(route))


class Runs:
    """The runs below a root directory, each with its :class:`RunData` and decoder, found again on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._data: dict[str, RunData] = {}
        self._paths: dict[str, Path] = {}
        self._decoders: dict[str, tuple[Decoder, str]] = {}

    def scan(self) -> list[tuple[str, Path]]:
        """Every run below the root now (``FileNotFoundError`` when there is none any more)."""
        found = [(run_id(self.root, p), p) for p in find_runs(self.root)]
        with self._lock:
            self._paths = dict(found)
        return found

    def path(self, rid: str) -> Path:
        """The run directory of ``rid`` (only a run found below the root: never an arbitrary path)."""
        if rid not in self._paths:
            self.scan()
        if rid not in self._paths:
            raise KeyError(f"no run {rid!r} under {self.root}")
        return self._paths[rid]

    def data(self, rid: str) -> RunData:
        """The :class:`RunData` of ``rid``, kept between requests."""
        path = self.path(rid)
        with self._lock:
            if rid not in self._data:
                self._data[rid] = RunData(path)
            return self._data[rid]

    def decoder(self, rid: str) -> tuple[Decoder, str]:
        """The token decoder of ``rid`` (loaded on first use)."""
        path = self.path(rid)
        with self._lock:
            if rid not in self._decoders:
                self._decoders[rid] = load_decoder(path)
            return self._decoders[rid]


def make_dashboard(root: str | Path, port: int = 0, verifier: Any | None = None) -> ThreadingHTTPServer:
    """The dashboard of every run below ``root`` (or of ``root``, a run) on ``127.0.0.1:port``.

    Raises ``FileNotFoundError`` (one line) when ``root`` holds no run; the caller checks that plotly
    is installed (:func:`plotly_js`), else ``/static/plotly.min.js`` answers 404 naming the extra.
    """
    runs = Runs(Path(root))
    runs.scan()
    js = plotly_js()
    cache: dict[str, bytes] = {}

    def route(path: str, q: dict[str, str]) -> _Reply:
        if path in ("/", "/index.html"):
            return _html(RUNS_PAGE)
        if path == "/api/runs":
            found = runs.scan()
            rows = [runs.data(rid).summary(rid) for rid, _ in found]
            return _json(200, {"root": str(runs.root), "runs": rows})
        if path in ("/compare/", "/compare"):
            return _html(COMPARE_PAGE)
        if path == "/api/compare":
            ids = [r for r in q.get("runs", "").split(",") if r]
            chosen = [(rid, runs.path(rid), runs.data(rid).rows()) for rid in ids]
            return _json(200, compare_doc(chosen, q.get("set", "heldout")))
        if path == "/static/plotly.min.js":
            if js is None:
                raise _json(404, {"error": f"plotly is not installed: {PLOT_EXTRA}"})
            if "js" not in cache:
                cache["js"] = js.read_bytes()
            return _Reply(200, cache["js"], "text/javascript; charset=utf-8",
                          {"Cache-Control": "max-age=3600"})
        parts = path.split("/")
        if len(parts) >= 3 and parts[1] == "run":
            rid, sub = unquote(parts[2]), "/".join(parts[3:])
            runs.path(rid)  # 404 for an unknown run
            if sub == "":
                if not path.endswith("/"):
                    raise _Reply(301, b"", "text/plain", {"Location": f"/run/{quote(rid, safe='')}/"})
                return _html(RUN_PAGE)
            if sub == "api/curves":
                keys = [k for k in q.get("keys", "").split(",") if k]
                after = _int(q, "after") if "after" in q else None
                gen = _int(q, "gen") if "gen" in q else None
                doc = runs.data(rid).curves(after, gen, keys, full=q.get("full") == "1")
                doc["has_ledger"] = (runs.path(rid) / "ledger").is_dir()
                return _json(200, doc)
            if sub == "api/summary":
                return _json(200, runs.data(rid).summary(rid))
            if sub == "api/symptoms":
                return _json(200, {"symptoms": runs.data(rid).symptoms()})
            if sub == "api/checkpoints":
                return _json(200, runs.data(rid).checkpoints())
            if sub == "api/config":
                return _json(200, runs.data(rid).config())
            if sub == "traj":
                raise _Reply(301, b"", "text/plain", {"Location": f"/run/{quote(rid, safe='')}/traj/"})
            if sub in ("traj/", "traj/index.html"):
                return _html(PAGE)
            if sub.startswith("traj/"):
                return _trajectory_api(runs.path(rid), sub[len("traj/") :], q, lambda: runs.decoder(rid),
                                       verifier)
        raise _json(404, {"error": f"no such page {path}"})

    return ThreadingHTTPServer((HOST, port), _handler(route))


def _int(q: dict[str, str], name: str) -> int:
    try:
        return int(q[name])
    except KeyError:
        raise ValueError(f"missing query parameter {name}") from None
    except ValueError:
        raise ValueError(f"query parameter {name}={q[name]!r} is not an integer") from None
