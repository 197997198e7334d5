"""``rollout.engine`` is a recipe choice: validated at config load, built by every mode and backend.

The http and vllm paths are driven end to end through the same subprocess machinery the vLLM
engine uses (:class:`~posttrain.rollout.server_process.SpawnedEngine`), here around the built-in
engine so it runs in the main environment; tests/rollout/test_vllm_engine.py does it with vLLM.
"""

from __future__ import annotations

import sys

import pytest

from posttrain.config import ConfigError
from posttrain.loop.builders import build_engine, build_model, engine_factory
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.rollout.http_engine import HTTPEngine
from posttrain.rollout.server_process import SpawnedEngine
from posttrain.trajectory import Ledger

pytestmark = pytest.mark.timeout(180)

SMALL = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
         "sampling.group_size=2", "sampling.max_new_tokens=3", "eval.size=4", "eval.every=100",
         "logging.progress=false", "guards.max_truncation_rate=1.0", "checkpoint_every=0", "sft.steps=0"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.engine=sglang"], "rollout.engine"),
    (["rollout.engine=http"], "rollout.http.url is required"),
    (["rollout.engine=http", "rollout.http.url=localhost:80"], "rollout.http.url must look like http://host:port"),
    (["rollout.engine=vllm", "rollout.vllm.python=/nonexistent/bin/python"], "make vllm-env"),
    (["rollout.engine=vllm", f"rollout.vllm.python={sys.executable}", "model.dtype=float64"],
     "rollout.vllm.dtype: vLLM has no float64"),
    (["rollout.vllm.kv_cache_gib=0"], "kv_cache_gib"),
    (["rollout.vllm.gpu_memory_utilization=1.5"], "gpu_memory_utilization"),
    (["rollout.vllm.flash=true"], "flash"),
])
def test_bad_rollout_keys_fail_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_run_config("grpo", overrides)


def test_engine_settings_are_typed_with_defaults():
    cfg = load_run_config("grpo", ["rollout.engine=vllm", f"rollout.vllm.python={sys.executable}",
                               "rollout.vllm.max_model_len=256", "rollout.vllm.enforce_eager=false"])
    v = cfg.rollout.vllm
    assert (cfg.rollout.engine, v.dtype, v.max_model_len, v.kv_cache_gib, v.enforce_eager, v.seed) == (
        "vllm", "auto", 256, 1, False, None)
    assert load_run_config("grpo").rollout.engine == "builtin"


def _builtin_server(tmp_path) -> SpawnedEngine:
    # A posttrain engine server around the built-in engine on a differently seeded micro model: the
    # run must load its own weights into it before the first rollout.
    return SpawnedEngine(sys.executable, "posttrain.rollout.http_engine:tiny_builtin_engine",
                         {"preset": "micro", "seed": 99}, log_path=tmp_path / "server.log", startup_timeout_s=120)


def test_train_with_the_http_engine_records_the_servers_versions(tmp_path):
    server = _builtin_server(tmp_path)
    try:
        st = train(load_run_config("grpo", [*SMALL, "steps=2", f"run_dir={tmp_path / 'run'}", "rollout.engine=http",
                                        f"rollout.http.url={server.base_url}"]))
        assert st.step == 2
        assert server.version == 2  # the learner's two updates reached the server, checksummed
        trajs = Ledger(tmp_path / "run" / "ledger").read_trajectories()
        versions = set()
        for t in trajs:
            versions |= set(t.behavior_version[t.action_mask.astype(bool)].tolist())
            # the server sampled with the run's weights (loaded at start), not its own seed-99 init
            assert abs(t.old_logprob - t.behavior_logprob).max() < 1e-4
        assert versions == {0, 1}  # step 1 sampled by v0, step 2 by v1: the server's recorded versions
    finally:
        server.close()
    assert server.proc.poll() is not None


def test_vllm_engine_without_vllm_in_its_environment_fails_with_the_build_command(tmp_path):
    # rollout.vllm.python points at an interpreter without vLLM (this one): the server dies at start-up
    # and the error quotes its log, which names the command that builds the vLLM environment.
    cfg = load_run_config("grpo", [*SMALL, f"run_dir={tmp_path}", "rollout.engine=vllm",
                               f"rollout.vllm.python={sys.executable}", "rollout.vllm.startup_timeout_s=120"])
    tok, model = build_model(cfg)
    with pytest.raises(RuntimeError, match="(?s)exited with code .*make vllm-env"):
        build_engine(model, tok, cfg, tmp_path)
    assert (tmp_path / "engine_model" / "config.json").is_file()  # exported for vLLM, HF format


def test_factories_are_picklable_for_the_ray_workers(tmp_path):
    import pickle

    cfg = load_run_config("grpo", [*SMALL, "rollout.engine=http", "rollout.http.url=http://127.0.0.1:9"])
    tok, model = build_model(cfg)
    f = pickle.loads(pickle.dumps(engine_factory(cfg, model, tok, tmp_path)))
    with pytest.raises(TimeoutError, match="not healthy"):  # nothing listens on port 9
        f.settings["connect_timeout_s"] = 0.5
        f()
    cfg = load_run_config("grpo", SMALL)
    eng = pickle.loads(pickle.dumps(engine_factory(cfg, model, tok, tmp_path)))()
    assert type(eng).__name__ == "BuiltinEngine" and not isinstance(eng, HTTPEngine)
