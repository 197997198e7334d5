"""One stub OpenAI-compatible chat server on 127.0.0.1 for the judge tests: ``serve(reply)`` starts it,
``reply(path, body)`` decides each POST's answer (an HTTP status and a body), and the server stops when the
``with`` block ends. ``chat_reply(text)`` is a 200 answer whose assistant message is ``text``.
``serve(reply, trickle_s=0.3)`` sends each whole answer (status line, headers, body) one byte every
``trickle_s`` seconds, a server that is up but slow (a trickle still under way stops with the server)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Reply = Callable[[str, dict], tuple[int, bytes]]


def chat_reply(text: str) -> tuple[int, bytes]:
    """A 200 chat-completions answer with one assistant message ``text``."""
    return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def between_r_tags(body: dict) -> str:
    """The text a ``... <r>{response}</r>`` prompt template put between the tags of the first message."""
    return str(body["messages"][0]["content"]).split("<r>", 1)[1].rsplit("</r>", 1)[0]


@contextmanager
def serve(reply: Reply, *, trickle_s: float = 0.0) -> Iterator[str]:
    """Serve ``reply`` on 127.0.0.1 (a free port) and yield the base URL; a status without a body is sent bare.
    ``trickle_s`` > 0: the answer is written one byte every ``trickle_s`` seconds, until the block ends."""
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, payload = reply(self.path, body)
            if trickle_s > 0:
                head = f"HTTP/1.0 {status} OK\r\nContent-Type: application/json\r\n"
                raw = f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload
                for i in range(len(raw)):  # bounded: len(raw) bytes, and nothing more once the server stops
                    if stop.wait(trickle_s):
                        return
                    self.wfile.write(raw[i:i + 1])
                return
            self.send_response(status)
            if payload:
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if payload:
                self.wfile.write(payload)

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # a slow reply written after the client timed out: the broken pipe is expected

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
