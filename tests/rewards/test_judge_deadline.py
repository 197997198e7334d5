"""One deadline per judge call (issue 38 item 1).

``reward.judge.timeout_s`` used to be urllib's per-read socket timeout: a judge that sent its reply one
byte every 0.5 s took ~53 s per call against ``timeout_s: 2, retries: 1`` (the documented bound being
``(retries + 1) x timeout_s`` plus the backoff, ~4 s), and the preflight passed; a judge answering in
5 s against ``timeout_s`` 2 was refused as "no judge answers there ... start the judge server first".
Now each attempt has one deadline for its connect, send and whole reply, and the preflight tells a
slow judge (accepted, no complete reply in time: raise ``reward.judge.timeout_s``) from a missing one.

Each slow case runs in a daemon thread joined with the documented bound plus slack, so on the old code
it fails at that bound instead of waiting out the trickle; every server stops when its test ends.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from posttrain.config import ConfigError
from posttrain.loop.preflight import check_judge
from posttrain.loop.validate import load_run_config
from posttrain.rewards.judge import LLMJudge
from posttrain.rewards.learned import add_component
from posttrain.rewards.verdict import Verdict
from posttrain.trajectory import Status
from tests._judge_stub import chat_reply, serve

TEMPLATE = "Q: {prompt}\nA: {response}\nCorrect?"
TIMEOUT_S, RETRIES, BACKOFF_S = 1.0, 1, 0.1
BOUND_S = (RETRIES + 1) * TIMEOUT_S + BACKOFF_S * (2**RETRIES - 1)  # 2 x 1.0 + 0.1 x 1 = 2.1 s, as documented
SLACK_S = 1.5
TRICKLE_S = 0.25  # the reply (~150 bytes with its headers) would take ~37 s
TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
        "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100", "steps=1"]


def _within(limit_s: float, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result (or the exception it raised) and its wall time; fails when it is still running after
    ``limit_s`` (a daemon thread: the old per-read timeout would have run for the whole trickle)."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(fn())
        except Exception as e:  # handed back to the test
            out.append(e)

    t0 = time.monotonic()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    elapsed = time.monotonic() - t0
    assert not t.is_alive(), f"still running after {limit_s:.1f} s (the deadline bounds nothing)"
    return out[0], elapsed


def _counting_yes(requests: list[str]) -> Callable[[str, dict], tuple[int, bytes]]:
    def reply(path: str, body: dict) -> tuple[int, bytes]:
        requests.append(path)
        return chat_reply("yes")

    return reply


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()  # nothing listens there now
    return port


def _cfg(url: str, timeout_s: float) -> Any:
    return load_run_config(None, [*TINY, f"reward.judge={{url: '{url}', timeout_s: {timeout_s}, retries: {RETRIES}}}"])


def test_a_trickling_judge_is_cut_at_the_documented_bound_and_the_row_is_infra_error() -> None:
    """Two rows, concurrency 2, each reply trickled one byte every 0.25 s: both rows end within
    (1 + 1) x 1.0 + 0.1 = 2.1 s (+ 1.5 s slack), after 2 attempts each (each attempt waits its whole 1 s:
    so not under 2.1 - 0.1 s), and each row is infra_error with no components (no zero reward)."""
    requests: list[str] = []
    with serve(_counting_yes(requests), trickle_s=TRICKLE_S) as url:
        judge = LLMJudge(url, prompt_template=TEMPLATE, parse="yes_no", timeout_s=TIMEOUT_S, retries=RETRIES,
                         backoff_s=BACKOFF_S, concurrency=2)
        verdicts = [Verdict(Status.CORRECT, {"task": 1.0}, "ok")] * 2
        out, elapsed = _within(BOUND_S + SLACK_S,
                               lambda: add_component(verdicts, ["p", "q"], ["r", "s"], "judge", judge.score_rows))
    assert not isinstance(out, Exception), out
    assert BOUND_S - 0.1 <= elapsed <= BOUND_S + SLACK_S, elapsed
    assert len(requests) == 4  # (retries + 1) attempts per row
    for v in out:
        assert v.status is Status.INFRA_ERROR and v.components == {}, v
        assert "timed out" in v.explanation and "timeout_s=1 s" in v.explanation, v.explanation
        assert "after 2 attempt(s)" in v.explanation and "the verifier said correct" in v.explanation


def test_a_reply_trickled_within_the_deadline_still_scores() -> None:
    """The same byte-by-byte reply at 0.005 s a byte (~0.75 s) within timeout_s = 5: the verdict is 1.0."""
    with serve(_counting_yes([]), trickle_s=0.005) as url:
        judge = LLMJudge(url, prompt_template=TEMPLATE, parse="yes_no", timeout_s=5.0, retries=0)
        assert judge.score_rows(["p"], ["r"]) == [1.0]


@pytest.mark.parametrize("slow", ["trickle", "late"])
def test_the_preflight_refuses_a_slow_judge_naming_timeout_s(slow: str) -> None:
    """``trickle``: the reply one byte every 0.25 s (the old preflight passed after ~37 s); ``late``: the
    whole reply after 3 s (the old preflight said "start the judge server first"). Against timeout_s = 1
    both are one line naming reward.judge.url and reward.judge.timeout_s=1, and not the missing-server advice."""
    released = threading.Event()

    def late(path: str, body: dict) -> tuple[int, bytes]:
        released.wait(3.0)
        return chat_reply("yes")

    reply = _counting_yes([]) if slow == "trickle" else late
    try:
        with serve(reply, trickle_s=TRICKLE_S if slow == "trickle" else 0.0) as url:
            cfg = _cfg(url, TIMEOUT_S)
            err, elapsed = _within(TIMEOUT_S + SLACK_S, lambda: check_judge(cfg))
    finally:
        released.set()
    assert isinstance(err, ConfigError), err
    msg = str(err)
    assert "\n" not in msg and f"reward.judge.url={url}" in msg, msg
    assert "reward.judge.timeout_s=1;" in msg and "raise reward.judge.timeout_s" in msg, msg
    assert "start the judge server first" not in msg, msg
    assert elapsed >= TIMEOUT_S - 0.05, elapsed  # it waited its whole deadline


def test_the_preflight_still_says_start_the_server_for_a_closed_port() -> None:
    """Nothing listens: refused at once, the old message (no word of timeout_s)."""
    url = f"http://127.0.0.1:{_free_port()}"
    err, _ = _within(SLACK_S, lambda: check_judge(_cfg(url, TIMEOUT_S)))
    assert isinstance(err, ConfigError), err
    msg = str(err)
    assert f"reward.judge.url={url}: no judge answers there (ConnectionRefusedError" in msg, msg
    assert "start the judge server first" in msg and "timeout_s" not in msg, msg


def test_the_preflight_passes_a_judge_that_answers_in_time() -> None:
    with serve(_counting_yes([])) as url:
        assert check_judge(_cfg(url, 5.0)) is None
