"""LLM judge against a stub OpenAI-compatible server on 127.0.0.1: parsing, retries, bounded time, infra errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from posttrain.config.feedback import JudgeConfig, RewardConfig
from posttrain.rewards.judge import JudgeReplyError, LLMJudge, endpoint, parse_reply, prompt_text
from tests._judge_stub import between_r_tags, chat_reply, serve

TEMPLATE = "Q: {prompt}\nA: {response}\nCorrect?"


class Stub:
    """What the stub server does next: a queue of behaviours, then ``default`` (one per request)."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.default = "reply:yes"
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def next(self) -> str:
        with self.lock:
            return self.script.pop(0) if self.script else self.default


@pytest.fixture
def stub() -> Iterator[tuple[Stub, str]]:
    state = Stub()

    def reply(path: str, body: dict) -> tuple[int, bytes]:
        with state.lock:
            state.requests.append({"path": path, **body})
        kind, _, arg = state.next().partition(":")
        if kind == "slow":
            time.sleep(float(arg))
            kind, arg = "reply", "yes"
        if kind == "status":
            return int(arg), b""
        if kind == "echo":  # yes when the response (after "A: ") is "4"
            arg = "yes" if "A: 4\n" in body["messages"][0]["content"] else "no"
        if kind == "score_len":  # "score: <length of the response>"
            arg = f"score: {len(between_r_tags(body))}"
        return (200, b"not json at all") if kind == "garbage" else chat_reply(arg)

    with serve(reply) as url:
        yield state, url


def _judge(url: str, **kw: object) -> LLMJudge:
    args: dict = dict(prompt_template=TEMPLATE, parse="yes_no", timeout_s=2.0, retries=1, backoff_s=0.0)
    args.update(kw)
    return LLMJudge(url, **args)


def test_yes_no_and_score_parsing_by_hand() -> None:
    assert parse_reply("Yes, it is.", "yes_no", "") == 1.0
    assert parse_reply("**no**", "yes_no", "") == 0.0
    for bad in ("yesterday", "maybe", ""):
        with pytest.raises(JudgeReplyError):
            parse_reply(bad, "yes_no", "")
    assert parse_reply("Score: 7.5/10", "score", r"(-?\d+(?:\.\d+)?)") == 7.5
    assert parse_reply("rating=3", "score", r"rating=(\d)") == 3.0
    with pytest.raises(JudgeReplyError, match="no score"):
        parse_reply("great answer", "score", r"(\d+)")
    assert prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == "u"


def test_verdicts_from_the_server_in_order_with_the_filled_template(stub) -> None:
    state, url = stub
    state.default = "echo"
    out = _judge(url, concurrency=3).score_rows(["2+2=", "2+2=", "1+3="], ["4", "5", "4"])
    assert out == [1.0, 0.0, 1.0]
    assert len(state.requests) == 3
    req = state.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["model"] == "judge" and req["temperature"] == 0
    assert sorted(r["messages"][0]["content"] for r in state.requests)[0] == "Q: 1+3=\nA: 4\nCorrect?"


@pytest.mark.parametrize("failure", ["status:500", "garbage", "reply:perhaps", "slow:1.5"])
def test_a_failure_is_retried_then_succeeds(stub, failure: str) -> None:
    state, url = stub
    state.script = [failure]
    assert _judge(url, timeout_s=0.5).score_rows(["p"], ["r"]) == [1.0]
    assert len(state.requests) == 2


@pytest.mark.parametrize("failure,why", [("status:500", "HTTP 500"), ("garbage", "malformed"),
                                         ("reply:perhaps", "neither yes nor no"), ("slow:1.0", "timed out")])
def test_persistent_failure_is_a_reason_after_bounded_attempts_never_a_number(stub, failure: str, why: str) -> None:
    state, url = stub
    state.default = failure
    t0 = time.monotonic()
    (out,) = _judge(url, timeout_s=0.3, retries=2).score_rows(["p"], ["r"])
    assert isinstance(out, str) and why in out and "after 3 attempt(s)" in out
    assert len(state.requests) == 3
    assert time.monotonic() - t0 < 3 * 0.3 + 2.0  # bounded: attempts x timeout (+ slack), not the server's 1 s x 3


def test_connection_refused_is_a_reason() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    (out,) = _judge(f"http://127.0.0.1:{port}", retries=0).score_rows(["p"], ["r"])
    assert isinstance(out, str) and "refused" in out.lower()


def test_non_local_urls_are_refused_at_load_and_at_build() -> None:
    for url in ("http://10.0.0.5:8000", "https://api.openai.com/v1", "http://judge.example:80", "ftp://127.0.0.1/"):
        with pytest.raises(ValidationError, match="reward.judge.url"):
            JudgeConfig(url=url)
        with pytest.raises(ValueError, match="LLM judge url"):
            endpoint(url)
    for url in ("http://127.0.0.1:8000", "http://localhost:1/v1/chat/completions", "http://[::1]:9"):
        assert endpoint(url).endswith("/v1/chat/completions")
        JudgeConfig(url=url)


def test_judge_config_checks_the_template_and_enters_its_weight() -> None:
    with pytest.raises(ValidationError, match=r"must contain \{response\}"):
        JudgeConfig(url="http://127.0.0.1:1", prompt_template="{prompt} only")
    with pytest.raises(ValidationError, match="only {prompt} and {response}"):
        JudgeConfig(url="http://127.0.0.1:1", prompt_template="{prompt} {response} {other}")
    with pytest.raises(ValidationError, match="not a regex"):
        JudgeConfig(url="http://127.0.0.1:1", score_pattern="(")
    r = RewardConfig(judge={"url": "http://127.0.0.1:1", "weight": 0.5}, model={"path": "x", "name": "rm2"})
    assert r.weights == {"task": 1.0, "judge": 0.5, "rm2": 1.0}
    assert r.learned_components() == {"rm2": 1.0, "judge": 0.5}
    with pytest.raises(ValidationError, match="used twice"):
        RewardConfig(judge={"url": "http://127.0.0.1:1", "name": "rm"}, model={"path": "x"})
    with pytest.raises(ValidationError, match="conflicts"):
        RewardConfig(weights={"task": 1.0, "judge": 2.0}, judge={"url": "http://127.0.0.1:1"})


def test_learned_reward_keys_that_cannot_take_effect_are_refused_at_load() -> None:
    from posttrain.config import ConfigError
    from posttrain.loop.validate import load_run_config

    with pytest.raises(ConfigError, match=r"reward.judge.score_pattern='\(x\)' cannot take effect: reward.judge.parse"):
        load_run_config("grpo", ["reward.judge.url=http://127.0.0.1:1", "reward.judge.score_pattern=(x)"])
    cfg = load_run_config("grpo", ["reward.judge.url=http://127.0.0.1:1", "reward.judge.parse=score",
                                   "reward.judge.score_pattern=(x)"])
    assert cfg.reward.judge is not None and cfg.reward.weights["judge"] == 1.0
    episodes = load_run_config("tool_calc", ["reward.model.path=m"])  # episodes get learned components too
    assert episodes.reward.model is not None and episodes.reward.weights["rm"] == 1.0
    with pytest.raises(ConfigError, match="reward.judge.url"):
        load_run_config("grpo", ["reward.judge.url=http://192.168.1.10:8000"])


def test_rl_records_the_judges_verdict_beside_the_verifiers(stub, tmp_path) -> None:
    """One GRPO step on builtin:micro with a stub judge scoring each response by its length: every
    trajectory's ledger components hold the verifier's and judge = len(response), total = task + 0.5 judge."""

    from posttrain.loop.training_loop import train
    from posttrain.loop.validate import load_run_config
    from posttrain.trajectory import Ledger, Status

    state, url = stub
    state.default = "score_len"
    d = tmp_path / "rl_judge"
    cfg = load_run_config("grpo", [
        "model.path=builtin:micro", "task.name=arithmetic", "task.kwargs={}", "sampling.prompts_per_step=2",
        "sampling.group_size=2", "sampling.max_new_tokens=3", "eval.size=2", "eval.every=1", "steps=1",
        "checkpoint_every=0", "sft.steps=0", "logging.progress=false", f"run_dir={d}", f"reward.judge.url={url}",
        "reward.judge.parse=score", "reward.judge.weight=0.5", "reward.judge.timeout_s=5",
        "reward.judge.prompt_template='Q: {prompt} A: <r>{response}</r>'"])
    train(cfg)
    trajs = Ledger(d / "ledger").read_trajectories()
    assert len(trajs) == 4
    for t in trajs:
        assert t.status is not Status.INFRA_ERROR
        comps = t.reward.components
        assert comps["judge"] == float(len(str(t.meta["response"])))
        assert t.reward.total == pytest.approx(comps["task"] + 0.5 * comps["judge"], abs=1e-12)
    assert {r["path"] for r in state.requests} == {"/v1/chat/completions"}
    assert len(state.requests) >= 4  # the training samples (and the held-out evaluations)
