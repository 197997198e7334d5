"""In a run: the learner re-renders each trajectory's recorded prompt before pi_old; a differing rendering
(another system prompt injected on the learner's side) stops the step, the run's own passes."""

from __future__ import annotations

import dataclasses
import json
import time

import pyarrow.parquet as pq
import pytest

from posttrain.config import RunConfig
from posttrain.envs.prompt_render import PromptMismatchError, PromptRenderer
from posttrain.loop.producer import build_producer
from posttrain.loop.run import open_run
from posttrain.loop.sampling_lifecycle import SamplingSource
from posttrain.loop.training_loop import update_step


def test_learner_side_rerendering_mismatch_is_caught_in_a_run(tmp_path) -> None:
    cfg = RunConfig.model_validate({
        "name": "prompt_check", "run_dir": str(tmp_path / "run"), "steps": 10,
        "model": {"path": "builtin:micro"},
        "task": {"name": "arithmetic", "kwargs": {"digits": 1}, "chat_template": True, "system_prompt": "Add."},
        "sampling": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
        "eval": {"every": 10, "size": 2},
    })
    run = open_run(cfg)
    producer = build_producer(cfg, SamplingSource.of(run))
    try:
        produced = producer.next_batch(1)
        trajs = produced.trajectories
        engine_side = run.parts.renderer
        assert engine_side.mode == "chat"
        # the engine sampled from <|system|>Add.<|user|>...<|assistant|> (ids 7 = <|system|>, 5 = <|assistant|>)
        for t in trajs:
            assert t.meta["prompt_format"] == "chat" and t.token_ids[0] == 7 and t.token_ids[t.prompt_length - 1] == 5
        # the learner's side differs
        learner_side = PromptRenderer(run.parts.tokenizer, chat=True, system_prompt="Sum.")
        run.parts = dataclasses.replace(run.parts, renderer=learner_side)
        version = run.parts.learner.version
        with pytest.raises(PromptMismatchError, match=r"prompt '.+' \(trajectory .+\).* at token 1 "):
            update_step(run, producer, 1, produced, time.perf_counter())
        assert run.parts.learner.version == version  # caught before pi_old and the update
        run.parts = dataclasses.replace(run.parts, renderer=engine_side)
        update_step(run, producer, 1, produced, time.perf_counter())
        assert run.parts.learner.version == version + 1
    finally:
        producer.close()
        run.close()
    rows = pq.read_table(tmp_path / "run" / "ledger" / "trajectories" / "step_000001.parquet").to_pylist()
    assert len(rows) == 4
    for r in rows:
        meta = json.loads(r["meta"])
        assert meta["prompt_format"] == "chat" and meta["chat_template"].startswith("sha256:")
        src = json.loads(meta["prompt_source"])["prompt"]
        want = engine_side.ids(type("Ex", (), {"prompt": src, "messages": None})())
        assert r["token_ids"][:len(want)] == want and r["action_mask"][len(want)] == 1
