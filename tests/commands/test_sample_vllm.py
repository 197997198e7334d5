"""``posttrain sample`` with ``rollout.engine=vllm`` against a real vLLM process (this CPU): the pass samples with
vLLM started from the vLLM environment (``make vllm-env``; tests/rollout/_vllm_env.py says how it is found or
opted out) in the output directory, writes a verdict for every sample and an ``sft.jsonl`` whose rows are exactly
the ledger's kept (correct, non-blank) samples, records ``engine: vllm`` in ``request.json`` and
``summary.json``, and leaves the server's log but not its model export. The model is the ``tiny`` preset
(head_dim 32: vLLM's CPU attention needs >= 32).

Verdicts are hand-built (sample ``j`` of a prompt is correct iff ``j`` is even: the random ``tiny`` model answers
no chain sum right) over vLLM's real samples, so the kept texts are vLLM's.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from _vllm_env import vllm_python, vllm_wanted  # noqa: E402

import posttrain.loop.rejection_sampling as rs  # noqa: E402
from posttrain.cli import main  # noqa: E402
from posttrain.rewards.verdict import Verdict  # noqa: E402
from posttrain.trajectory import Ledger, Status  # noqa: E402

pytestmark = pytest.mark.timeout(900)

RUN = ["model.path=builtin:tiny", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
       "sampling.max_new_tokens=6", "eval.size=8", "logging.progress=false"]


@pytest.mark.parametrize("engine", ["vllm"] if vllm_wanted() else [], ids=str)
def test_sample_with_vllm_keeps_the_verified_samples(tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    real = rs.play_once

    def judge_by_index(*a: Any, **kw: Any) -> Any:
        played = real(*a, **kw)
        verdicts = [Verdict(Status.CORRECT if c.sample_index % 2 == 0 else Status.WRONG,
                            {"task": float(c.sample_index % 2 == 0)}) for c in played.completions]
        return dataclasses.replace(played, verdicts=verdicts)

    monkeypatch.setattr(rs, "play_once", judge_by_index)
    out = tmp_path / "rs"
    args = ["sample", "grpo", f"rollout.engine={engine}", f"rollout.vllm.python={vllm_python()}", *RUN, "--k", "2",
            "--prompts", "2", "--keep-per-prompt", "2", "--out", str(out), "--no-progress"]
    rc = main(args)
    log = out / "engine_server.log"
    assert rc == 0, capsys.readouterr().err[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    summary = json.loads(capsys.readouterr().out)
    trajs = Ledger(out / "ledger").read_trajectories()
    assert len(trajs) == 4 and [t.status for t in trajs] == [Status.CORRECT, Status.WRONG] * 2
    verified = [t for t in trajs if t.status is Status.CORRECT and str(t.meta["response"]).strip()]
    assert verified  # vLLM's texts (seeded): not blank
    rows = [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]
    assert [(r["source"], r["completion"]) for r in rows] == [(t.traj_id, t.meta["response"]) for t in verified]
    assert [t.meta["kept"] for t in trajs] == [t in verified for t in trajs] and summary["kept"] == len(verified)
    assert summary["engine"] == "vllm" and json.loads((out / "request.json").read_text())["engine"] == "vllm"
    assert log.stat().st_size > 0 and not (out / "engine_model").exists()  # vLLM ran here; its export is gone
