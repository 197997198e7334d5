"""The built-in engine in its own process (posttrain/rollout/builtin_server.py): the same engine as in-process.

The server is started from the run's model the way ``rollout.process: server`` starts it
(:func:`builtin_server_factory`), and the run drives it over HTTP (``rollout.engine=http`` pointing at
it: the same client, weight packets and versions). A short run's ledger must record the behaviour
distribution of the in-process run: same tokens, behaviour log-probs within the float tolerance of
tests/_tolerance.py, same behaviour versions and policy lags, in every system mode whose schedule is
deterministic (sync, one_step_off, partial rollout); async, whose interleaving depends on timing,
must keep its staleness bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posttrain.config import ConfigError
from posttrain.loop.builders import build_model
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.builtin_server import builtin_server_factory, export_model, load_model
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest
from posttrain.trajectory import Ledger
from tests._tolerance import shape_rtol

pytestmark = pytest.mark.timeout(600)

SMALL = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
         "sampling.group_size=3", "sampling.max_new_tokens=4", "eval.size=4", "eval.every=100",
         "logging.progress=false", "guards.max_truncation_rate=1.0", "checkpoint_every=0", "sft.steps=0",
         "steps=3", "optim.lr=3e-3"]
MODES = {
    "sync": [],
    "one_step_off": ["system.mode=one_step_off", "correction.name=tis"],
    "partial": ["system.partial_fraction=0.5", "system.max_version_span=2", "correction.name=tis"],
}


def test_export_round_trip_keeps_weights_and_config(tmp_path):
    cfg = load_run_config("grpo", SMALL)
    _, model = build_model(cfg)
    back = load_model(export_model(model, tmp_path / "m.pt"))
    assert type(back) is type(model) and back.config.to_dict() == model.config.to_dict()
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k


def test_server_generates_and_updates_like_the_in_process_engine(tmp_path):
    cfg = load_run_config("grpo", SMALL)
    tok, model = build_model(cfg)
    local = BuiltinEngine(model, tok, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0)
    server = builtin_server_factory(model, tmp_path, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id or 0, threads=1).start()
    try:
        reqs = [GenerationRequest(f"r{i}", [5, 6, 7 + i], SamplingParams(n=2, max_new_tokens=5, seed=3 + i))
                for i in range(2)]
        new = {k: v.detach() + 0.01 * torch.randn_like(v) for k, v in model.named_parameters()}  # tied: one tensor
        for step in range(2):  # before and after a weight update (version 0, then 7)
            a, b = local.generate(reqs), server.generate(reqs)
            assert [(c.request_id, c.sample_index, c.token_ids, c.versions) for c in a] == [
                (c.request_id, c.sample_index, c.token_ids, c.versions) for c in b]
            la = torch.tensor([x for c in a for x in c.logprobs], dtype=torch.float64)
            lb = torch.tensor([x for c in b for x in c.logprobs], dtype=torch.float64)
            assert float((la - lb).abs().max()) <= shape_rtol(16) * max(1.0, float(la.abs().max()))
            if step == 0:
                local.update_weights(new, version=7)
                server.update_weights(new, version=7)
        assert server.version == 7
        assert (tmp_path / "engine_server.log").exists()
    finally:
        server.close()
    assert server.proc.poll() is not None


def _run(tmp_path, name, extra, server=None):
    url = [] if server is None else ["rollout.engine=http", f"rollout.http.url={server.base_url}"]
    run_dir = tmp_path / name
    st = train(load_run_config("grpo", [*SMALL, f"run_dir={run_dir}", *extra, *url]))
    return st, Ledger(run_dir / "ledger").read_trajectories()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_runs_ledger_is_the_same_in_process_and_in_a_server(tmp_path, mode):
    st_a, a = _run(tmp_path, "in_process", MODES[mode])
    cfg = load_run_config("grpo", SMALL)
    tok, model = build_model(cfg)  # the run's initial model (same seed): what the server is started from
    server = builtin_server_factory(model, tmp_path / "srv", eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id or 0, threads=1).start()
    try:
        st_b, b = _run(tmp_path, "server", MODES[mode], server)
        assert server.version == st_b.step  # every update reached the server process
    finally:
        server.close()
    assert st_a.step == st_b.step == 3 and len(a) == len(b) > 0
    for ta, tb in zip(a, b, strict=True):
        assert (ta.traj_id, ta.token_ids.tolist(), ta.status) == (tb.traj_id, tb.token_ids.tolist(), tb.status)
        m = ta.action_mask.astype(bool)
        assert tb.action_mask.astype(bool).tolist() == m.tolist()
        assert ta.behavior_version[m].tolist() == tb.behavior_version[m].tolist()
        assert ta.policy_lag == tb.policy_lag
        rtol = shape_rtol(int(ta.token_ids.size))
        assert np.abs(ta.behavior_logprob[m] - tb.behavior_logprob[m]).max(initial=0.0) <= rtol * max(
            1.0, float(np.abs(ta.behavior_logprob[m]).max(initial=0.0)))
    if mode == "one_step_off":
        assert {tb.policy_lag for tb in b} == {0, 1}  # lag exactly 1 after step 1, as in-process


def test_async_in_a_server_keeps_its_staleness_bound(tmp_path):
    cfg = load_run_config("grpo", SMALL)
    tok, model = build_model(cfg)
    server = builtin_server_factory(model, tmp_path / "srv", eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id or 0, threads=1).start()
    try:
        st, b = _run(tmp_path, "async", ["system.mode=async", "system.max_staleness=1", "correction.name=tis"], server)
        assert server.version == st.step == 3
    finally:
        server.close()
    assert b and max(int(t.policy_lag or 0) for t in b) <= 1
    for t in b:  # every token carries a version the server actually held (0 .. 2 before the last update)
        assert set(t.behavior_version[t.action_mask.astype(bool)].tolist()) <= {0, 1, 2}


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.engine=vllm", "rollout.process=server"], "rollout.process=server applies to rollout.engine=builtin"),
    (["rollout.engine=http", "rollout.http.url=http://127.0.0.1:9", "rollout.process=server"],
     "rollout.process=server applies to rollout.engine=builtin"),
    (["rollout.process=thread"], "rollout.process"),
    (["rollout.server.threads=-1"], "rollout.server.threads"),
])
def test_bad_process_keys_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_run_config("grpo", overrides)


def test_process_server_is_a_valid_builtin_setting():
    rc = load_run_config("grpo", ["rollout.process=server", "rollout.server.threads=1"]).rollout
    assert (rc.engine, rc.process, rc.server.threads) == ("builtin", "server", 1)
