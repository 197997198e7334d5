"""Issue 22, deliverable 3: engine settings that cannot serve the model fail while the run is built.

``rollout.engine=vllm`` with the ``micro`` preset (head_dim 8; vLLM's CPU attention has no kernel for
it) used to start the server, write config.yaml and metrics.jsonl, and fail at the step-0
evaluation with an HTTP 500 (exit 1). ``build_engine`` now sends one greedy 1-token request
(:func:`posttrain.loop.builders.probe_engine`): the failure is one line naming ``rollout.engine``,
the engine server is closed and the fresh run directory is gone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.loop.builders import probe_engine
from posttrain.models import build_char_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vllm_env import vllm_python, vllm_wanted  # noqa: E402


class _Engine:
    def __init__(self, fail: bool) -> None:
        self.fail, self.closed, self.requests = fail, False, []

    def generate(self, requests):
        self.requests.extend(requests)
        if self.fail:
            raise RuntimeError("http://127.0.0.1:1/generate: HTTP 500: RuntimeError: no kernel\nsecond line")
        return []

    def close(self) -> None:
        self.closed = True


def test_probe_engine_sends_one_greedy_token_and_closes_a_failing_engine():
    tok = build_char_tokenizer()
    ok = _Engine(fail=False)
    probe_engine(ok, tok, "rollout.engine=http")
    (req,) = ok.requests
    assert (req.params.temperature, req.params.max_new_tokens, req.params.n) == (0.0, 1, 1)
    assert req.prompt_ids == list(tok("1").input_ids) and not ok.closed

    bad = _Engine(fail=True)
    with pytest.raises(ValueError) as e:
        probe_engine(bad, tok, "rollout.engine=vllm")
    msg = str(e.value)
    assert msg.startswith("rollout.engine=vllm: the engine cannot serve this model") and "no kernel" in msg
    assert "\n" not in msg and bad.closed


@pytest.mark.skipif(not vllm_wanted(), reason="POSTTRAIN_TEST_VLLM=0")
@pytest.mark.timeout(600)
def test_vllm_that_cannot_serve_the_model_fails_before_anything_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["train", "grpo", "rollout.engine=vllm", f"rollout.vllm.python={vllm_python()}", "model.path=builtin:micro",
               "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2", "sampling.group_size=2",
               "eval.size=4", "steps=1", f"run_dir={run_dir}", "--no-progress"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("posttrain train:")]
    assert rc == 2 and "Traceback" not in err, err
    (line,) = lines
    assert "rollout.engine=vllm: the engine cannot serve this model" in line and "head_dim=8" in line
    assert not run_dir.exists()
