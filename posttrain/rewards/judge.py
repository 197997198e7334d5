"""An LLM judge as a reward component: an OpenAI-compatible ``/v1/chat/completions`` server on this machine.

Each response is sent as one chat request (``prompt_template`` filled with the prompt and the response,
temperature 0) to a server on a loopback address only (a non-local URL is refused when the judge is
built, and the config refuses it at load). The reply's text is parsed: ``yes_no`` reads a leading
``yes`` (1.0) or ``no`` (0.0); ``score`` reads the first match of a regex as a number. A call that
fails (connection refused, HTTP error, timeout), or whose reply is malformed or unparseable, is
retried up to ``retries`` times; then the row has no value but a reason, which
:mod:`posttrain.rewards.learned` turns into an ``infra_error`` verdict (never a zero reward). Every
call is bounded by ``timeout_s`` (urllib's socket timeout), and the number of attempts by
``retries + 1``; ``concurrency`` calls are in flight at once. Proxies are never used.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Literal

from posttrain.config.feedback import local_url_error

CHAT_PATH = "/v1/chat/completions"
_YES_NO = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)


class JudgeReplyError(ValueError):
    """The judge answered, but not with a readable verdict (retried, then an infra error)."""


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
    (doubling); the attempts of one row take at most ``(retries + 1) * timeout_s`` plus the backoffs.
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
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy

    def _call(self, content: str) -> float:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}],
                           "temperature": 0, "max_tokens": self.max_tokens}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        with self._opener.open(req, timeout=self.timeout_s) as resp:
            return parse_reply(reply_text(resp.read()), self.parse, self.pattern)

    def ask(self, prompt: str | Sequence[Mapping[str, str]], response: str) -> float | str:
        """The parsed verdict on ``response``, or (after ``retries + 1`` failed attempts) why there is none."""
        content = self.template.format(prompt=prompt_text(prompt), response=response)
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._call(content)
            except urllib.error.HTTPError as e:
                why = f"HTTP {e.code} {e.reason}"
            except JudgeReplyError as e:
                why = str(e)
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, timeout, cut
                reason = getattr(e, "reason", e)
                why = f"{type(reason).__name__}: {reason}"
        return f"LLM judge {self.url}: {why} (after {self.retries + 1} attempt(s))"[:300]

    def unreachable(self) -> str | None:
        """Why no judge answers at :attr:`url` (one request, no retry: refused, timed out, an HTTP error), or
        None when it answered, whatever it said (a reply it cannot parse is a row's failure, not a dead judge)."""
        try:
            self._call(self.template.format(prompt="1 + 1", response="2"))
        except JudgeReplyError:
            return None
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code} {e.reason}"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            return f"{type(reason).__name__}: {reason}"
        return None

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
