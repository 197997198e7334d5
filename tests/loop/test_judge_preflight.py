"""An LLM judge that does not answer is refused before the run directory is written.

With ``reward.judge.url`` pointing at no server, ``posttrain train`` used to write the run directory, run
the step-0 evaluation and a training step whose every sample was an ``infra_error``, and only then stop
with "nothing could be judged". The preflight now sends the judge one request: no HTTP answer (refused,
timed out) or an HTTP error is one line naming ``reward.judge.url``; an answer it cannot parse is the
rows' business (retried, then ``infra_error``), not the probe's.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config import ConfigError
from posttrain.loop.preflight import preflight
from posttrain.loop.validate import load_run_config
from tests._cli_errors import one_error_line
from tests._judge_stub import chat_reply, serve

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
        "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100", "steps=1"]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()  # nothing listens there now
    return port


def test_a_judge_nobody_answers_fails_at_load_before_the_run_dir(tmp_path: Path, capsys) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    run_dir = tmp_path / "run"
    judge = f"reward.judge={{url: '{url}', timeout_s: 2, retries: 0}}"
    assert main(["train", "grpo", *TINY, "sft.steps=0", "sft.examples=2000", "sft.batch_size=64", "sft.lr=0.003",
                 judge, f"run_dir={run_dir}", "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert f"reward.judge.url={url}" in line and "refused" in line.lower(), line
    assert not run_dir.exists()


@pytest.mark.parametrize("status, ok", [(200, True), (404, False)], ids=["answers", "http_404"])
def test_a_judge_that_answers_passes_whatever_it_says(status: int, ok: bool) -> None:
    def reply(path: str, body: dict) -> tuple[int, bytes]:
        return chat_reply("I cannot tell") if status == 200 else (status, b"")  # unparseable for yes_no: fine

    with serve(reply) as url:
        cfg = load_run_config(None, [*TINY, f"reward.judge={{url: '{url}', timeout_s: 2}}"])
        if ok:
            assert preflight(cfg) is None
        else:
            with pytest.raises(ConfigError, match=r"reward\.judge\.url=.*HTTP 404") as e:
                preflight(cfg)
            # something answered: the advice is the path, not starting a server (issue 38)
            assert "a server answers there" in str(e.value) and "start the judge server" not in str(e.value)
