"""An LLM judge as a reward component: an OpenAI-compatible ``/v1/chat/completions`` server on this machine.

Each response is sent as one chat request (``prompt_template`` filled with the prompt and the response,
temperature 0) to a server on a loopback address only (a non-local URL is refused when the judge is
built, and the config refuses it at load). The reply's text is parsed: ``yes_no`` reads a leading
``yes`` (1.0) or ``no`` (0.0); ``score`` reads the first match of a regex as a number. A call that
fails (connection refused, HTTP error, timeout), or whose reply is malformed or unparseable, is
retried up to ``retries`` times; then the row has no value but a reason, which
:mod:`posttrain.rewards.learned` turns into an ``infra_error`` verdict (never a zero reward).

``timeout_s`` is one deadline per HTTP attempt covering the connect, the send and the whole reply
(status line, headers, body): the socket timeout of every connect, send and receive is the time left
before it, so a server that trickles its reply byte by byte is cut at ``timeout_s`` (urllib's timeout was
per read, and such a server took ~50 s per call against ``timeout_s`` = 2). One row therefore takes at most
``(retries + 1) * timeout_s + backoff_s * (2 ** retries - 1)`` seconds (the attempts plus the doubling
backoffs between them; ``backoff_s`` = 0.1 in a run), up to the scheduler's jitter and the parsing of
the reply. ``concurrency`` calls are in flight at once. Proxies are never used.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import io
import json
import math
import re
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Literal
from urllib.parse import urlsplit

from posttrain.config.feedback import local_url_error

CHAT_PATH = "/v1/chat/completions"
_YES_NO = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)


class JudgeReplyError(ValueError):
    """The judge answered, but not with a readable verdict (retried, then an infra error)."""


class JudgeHTTPError(Exception):
    """The judge answered an HTTP status outside 2xx (retried, then an infra error); ``str`` is ``HTTP 500 ...``."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status


class JudgeTimeout(TimeoutError):
    """One attempt ran past its ``timeout_s`` deadline. ``connected``: the server had accepted the connection
    (it runs, but its whole reply did not arrive in time) rather than no connection being accepted in time."""

    def __init__(self, message: str, *, connected: bool) -> None:
        super().__init__(message)
        self.connected = connected


class _DeadlineSocket:
    """A connected socket whose every send and receive ends by ``deadline`` (``time.monotonic()`` seconds):
    each one's socket timeout is the time left before it, and none left is a :class:`JudgeTimeout`; so a
    reply trickled byte by byte cannot outlast the deadline (a fixed per-read timeout restarts each byte).
    It has what :class:`http.client.HTTPConnection` and :class:`http.client.HTTPResponse` use of a socket."""

    def __init__(self, sock: socket.socket, deadline: float, timeout_s: float) -> None:
        self.sock, self.deadline, self.timeout_s = sock, deadline, timeout_s

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise JudgeTimeout(f"timed out: connected, but no complete reply within timeout_s={self.timeout_s:g} s",
                               connected=True)
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        """Send all of ``data`` by the deadline (each ``send`` moves >= 1 byte or raises)."""
        view = memoryview(data)
        while view:
            self._arm()
            view = view[self.sock.send(view):]

    def recv_into(self, buf: memoryview | bytearray) -> int:
        """One receive into ``buf`` within the time left; 0 at the end of the stream."""
        self._arm()
        return self.sock.recv_into(buf)

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        """A buffered reader whose every underlying receive is :meth:`recv_into` (``mode`` is always ``rb``)."""
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        """Nothing: http.client closes its connection before the body of a closing reply is read (a real
        socket's ``makefile`` keeps it open until then); :meth:`LLMJudge._post` closes :attr:`sock` at the end."""


class _DeadlineReader(io.RawIOBase):
    """The raw stream of a :class:`_DeadlineSocket` (what ``makefile`` wraps in a buffer)."""

    def __init__(self, sock: _DeadlineSocket) -> None:
        super().__init__()
        self._sock = sock

    def readable(self) -> bool:
        """Always True."""
        return True

    def readinto(self, buf: memoryview | bytearray) -> int:  # type: ignore[override]
        """One deadline-bounded receive into ``buf``."""
        return self._sock.recv_into(buf)


def endpoint(url: str) -> str:
    """``url`` with :data:`CHAT_PATH` appended unless it already ends with it; ``ValueError`` when not local."""
    why = local_url_error(url)
    if why is not None:
        raise ValueError(f"LLM judge url {url!r}: {why}")
    base = url.rstrip("/")
    return base if base.endswith(CHAT_PATH) else base + CHAT_PATH


def parse_reply(text: str, parse: Literal["yes_no", "score"], pattern: str) -> float:
    """The component value of a judge's reply ``text``: ``yes_no``: 1.0 / 0.0 for a leading yes / no
    (case and leading punctuation ignored); ``score``: group 1 (else the whole match) of the first match of
    ``pattern``. :class:`JudgeReplyError` when there is none or it is not a finite number."""
    if parse == "yes_no":
        m = _YES_NO.match(text)
        if m is None:
            raise JudgeReplyError(f"reply is neither yes nor no: {text[:80]!r}")
        return 1.0 if m.group(1).lower() == "yes" else 0.0
    m = re.search(pattern, text)
    if m is None:
        raise JudgeReplyError(f"no score matching {pattern!r} in reply {text[:80]!r}")
    raw = m.group(1) if m.groups() else m.group(0)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise JudgeReplyError(f"score {raw!r} is not a number (reply {text[:80]!r})") from None
    if not math.isfinite(value):
        raise JudgeReplyError(f"score {raw!r} is not finite")
    return value


def reply_text(body: bytes) -> str:
    """``choices[0].message.content`` of a chat-completions response body; :class:`JudgeReplyError` otherwise."""
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise JudgeReplyError(f"malformed chat-completions reply ({type(e).__name__}): {body[:80]!r}") from None
    if not isinstance(content, str):
        raise JudgeReplyError(f"reply content is {type(content).__name__}, not text")
    return content


def prompt_text(prompt: str | Sequence[Mapping[str, str]]) -> str:
    """What ``{prompt}`` stands for: the prompt, or a chat's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return str(users[-1]) if users else "\n".join(str(m["content"]) for m in prompt)


class LLMJudge:
    """Scores ``(prompt, response)`` rows by asking a local LLM (see the module docstring).

    ``component`` names its value in verdicts. ``backoff_s`` is slept between attempts of one row
    (doubling). Each attempt has one deadline of ``timeout_s`` for its connect, send and whole reply, so
    one row takes at most ``(retries + 1) * timeout_s + backoff_s * (2 ** retries - 1)`` seconds.
    """

    def __init__(self, url: str, *, model: str = "judge", prompt_template: str, parse: Literal["yes_no", "score"],
                 score_pattern: str = r"(-?\d+(?:\.\d+)?)", timeout_s: float = 30.0, retries: int = 2,
                 concurrency: int = 4, max_tokens: int = 16, component: str = "judge", backoff_s: float = 0.1) -> None:
        if timeout_s <= 0 or retries < 0 or concurrency < 1 or backoff_s < 0:
            raise ValueError(f"LLMJudge: need timeout_s > 0, retries >= 0, concurrency >= 1, backoff_s >= 0; got "
                             f"{timeout_s}, {retries}, {concurrency}, {backoff_s}")
        self.url = endpoint(url)
        self.model, self.template, self.parse, self.pattern = model, prompt_template, parse, score_pattern
        self.timeout_s, self.retries, self.concurrency = timeout_s, retries, concurrency
        self.max_tokens, self.component, self.backoff_s = max_tokens, component, backoff_s
        parts = urlsplit(self.url)  # connected to directly: never through a proxy
        self._tls = parts.scheme == "https"
        self._host, self._port = str(parts.hostname), parts.port or (443 if self._tls else 80)
        self._path = parts.path + (f"?{parts.query}" if parts.query else "")

    def _connect(self, deadline: float) -> socket.socket:
        """A TCP connection to the judge, each resolved address tried with the time left before ``deadline``;
        else the last address's ``OSError`` (refused, ...) or a :class:`JudgeTimeout` (not ``connected``)."""
        why: OSError = OSError(f"{self._host!r} resolves to no address")
        for family, kind, proto, _, addr in socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(left)
                sock.connect(addr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as e:
                sock.close()
                why = e
        if isinstance(why, TimeoutError) or deadline <= time.monotonic():
            why = JudgeTimeout(f"timed out: no connection accepted within timeout_s={self.timeout_s:g} s",
                               connected=False)
        raise why

    def _post(self, body: bytes) -> bytes:
        """The body of a 2xx reply to one POST of ``body`` to :attr:`url`, all within ONE deadline of
        ``timeout_s`` from now: connect, TLS handshake, send, status line, headers and body. Raises
        :class:`JudgeTimeout` past the deadline, :class:`JudgeHTTPError` for another status (its body
        unread), ``OSError`` / :class:`http.client.HTTPException` when refused, reset or cut short."""
        deadline = time.monotonic() + self.timeout_s
        sock = self._connect(deadline)
        conn = http.client.HTTPConnection(self._host, self._port)
        try:
            if self._tls:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))  # the whole handshake (ssl's own deadline)
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
            conn.sock = _DeadlineSocket(sock, deadline, self.timeout_s)
            conn.request("POST", self._path, body=body,
                         headers={"Content-Type": "application/json", "Connection": "close"})
            resp = conn.getresponse()
            if not 200 <= resp.status < 300:
                raise JudgeHTTPError(resp.status, resp.reason)
            return resp.read()
        except JudgeTimeout:
            raise
        except TimeoutError:  # a send or receive that the time left did not cover
            raise JudgeTimeout(f"timed out: connected, but no complete reply within timeout_s={self.timeout_s:g} s",
                               connected=True) from None
        finally:
            conn.close()
            sock.close()

    def _call(self, content: str) -> float:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}],
                           "temperature": 0, "max_tokens": self.max_tokens}).encode()
        return parse_reply(reply_text(self._post(body)), self.parse, self.pattern)

    def ask(self, prompt: str | Sequence[Mapping[str, str]], response: str) -> float | str:
        """The parsed verdict on ``response``, or (after ``retries + 1`` failed attempts) why there is none."""
        content = self.template.format(prompt=prompt_text(prompt), response=response)
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._call(content)
            except (JudgeHTTPError, JudgeReplyError) as e:
                why = str(e)
            except (OSError, http.client.HTTPException) as e:  # refused, reset, cut, timed out (JudgeTimeout)
                why = f"{type(e).__name__}: {e}"
        return f"LLM judge {self.url}: {why} (after {self.retries + 1} attempt(s))"[:300]

    def probe(self) -> tuple[Literal["answers", "http_error", "slow", "down"], str]:
        """One request, no retry, and what came of it with why: ``answers`` (a 2xx reply within ``timeout_s``,
        whatever it said: a reply it cannot parse is a row's failure, not a dead judge; why is ``""``),
        ``http_error`` (another status), ``slow`` (the server accepted the connection but its whole reply
        did not arrive within ``timeout_s``), ``down`` (refused, unknown host, reset or cut short, or no
        connection accepted within ``timeout_s``)."""
        try:
            self._call(self.template.format(prompt="1 + 1", response="2"))
        except JudgeReplyError:
            pass
        except JudgeHTTPError as e:
            return "http_error", str(e)
        except JudgeTimeout as e:
            return ("slow" if e.connected else "down"), f"{type(e).__name__}: {e}"
        except (OSError, http.client.HTTPException) as e:
            return "down", f"{type(e).__name__}: {e}"
        return "answers", ""

    def score_rows(self, prompts: Sequence[str | Sequence[Mapping[str, str]]],
                   responses: Sequence[str]) -> list[float | str]:
        """:meth:`ask` of every row, ``concurrency`` at a time, in order."""
        if len(prompts) != len(responses):
            raise ValueError(f"LLMJudge: {len(prompts)} prompts for {len(responses)} responses")
        if not prompts:
            return []
        with cf.ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts)),
                                   thread_name_prefix="llm-judge") as ex:
            return list(ex.map(self.ask, prompts, responses))
