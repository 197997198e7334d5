"""Learner ranks as Ray actors on a simulated multi-node cluster (``ray.cluster_utils.Cluster``).

Three raylets on this machine: a head with no CPU (only the GCS: it must survive the test), node A (one
CPU, the ``rollout_node`` resource that pins the rollout worker) and node B (one CPU). ``posttrain train
grpo system.backend=ray learner.strategy=fsdp2 learner.world_size=2`` joins it: the two learner ranks
are SPREAD over A and B (a process group over the nodes' address), the rollout worker sits on A.

One run covers equality and the node failure: before its fifth update the node holding rank 1 is
removed (``_ray_learner_run.py`` holds the update until then, and until Ray has declared the node
dead); the run must fail naming rank 1 and its node, in bounded time. Its steps 1-4 (grad norms, the step-4 checkpoint's weights; the first reward signal comes at step 4) equal the
single-process run's within the rank tolerance of test_learner_ranks.py (shape_rtol of the longest
sequence; whole updates within 100x). Then a new node C joins (another placement) and ``resume=true``
on ONE rank (another world size) continues from the step-4 sharded checkpoint to the end, where it equals the single-process run too.
The weights reach the rollout worker directly from rank 0's actor (``system.ray.weight_sync=direct``,
the default): the object store of the node holding rank 0, read by the worker on node A.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import shape_rtol, update_rel_diff  # noqa: E402

HERE = Path(__file__).resolve().parent
LOOP_TESTS = HERE.parent / "loop"  # flaky_task lives there
STEPS = 6
BASE = ["model.path=builtin:micro", "model.dtype=float64", "task.name=flaky_task:digit_first",
        "task.kwargs={terms: 2}", "sampling.prompts_per_step=2", "sampling.group_size=4",
        "sampling.max_new_tokens=2", "eval.size=1", "eval.every=100", "logging.progress=false",
        "guards.max_truncation_rate=1.0", "optim.microbatch_tokens=24", f"steps={STEPS}", "sft.steps=0",
        "optim.num_minibatches=1", "checkpoint_every=2", "system.mode=sync"]
RAY = ["system.backend=ray", "system.ray.placement=disaggregated", "system.ray.num_rollout_workers=1",
       "system.ray.num_reward_workers=0", "system.ray.cpus_per_rollout_worker=0.2",
       "system.ray.rollout_resources={rollout_node: 1}", "system.ray.startup_timeout_s=120",
       "learner.startup_timeout_s=240", "learner.rank_timeout_s=120"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(LOOP_TESTS), os.environ.get("PYTHONPATH", "")])}


def _tail(out: str) -> str:
    """The run's own lines (Ray's raylet state dumps left out), last 3000 characters."""
    return "\n".join(ln for ln in out.splitlines() if "[state-dump]" not in ln)[-3000:]


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _grad_norms(run_dir: Path) -> dict[int, float]:
    return {int(m["step"]): float(m["grad_norm"]) for m in _metrics(run_dir) if "grad_norm" in m}


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "actor" / "model.safetensors"))


def _start() -> dict[str, torch.Tensor]:
    from posttrain.models import build_char_tokenizer, build_tiny_model

    return build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=0, dtype=torch.float64).state_dict()


def _rtol(run_dir: Path) -> float:
    from posttrain.trajectory import Ledger

    return float(shape_rtol(max(len(t.token_ids) for t in Ledger(run_dir / "ledger").read_trajectories())))


def _assert_equal_runs(run: Path, ref: Path, steps: list[int], at_step: int) -> None:
    """grad_norm of ``steps`` and the update up to ``at_step``'s checkpoint equal the reference's."""
    rtol = _rtol(ref)
    gn_run, gn_ref = _grad_norms(run), _grad_norms(ref)
    assert any(gn_ref[s] > 0 for s in steps), "no gradient in the compared steps: nothing is compared"
    for s in steps:
        assert gn_run[s] == pytest.approx(gn_ref[s], rel=rtol, abs=1e-300), (s, gn_run[s], gn_ref[s])
    w_ref = _weights(ref, at_step)
    start = {k: v for k, v in _start().items() if k in w_ref}
    d = update_rel_diff(_weights(run, at_step), w_ref, start)
    assert d <= 100 * rtol, (d, rtol)


@pytest.fixture(scope="module")
def cluster() -> Any:
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0})
    try:
        a = c.add_node(num_cpus=1, resources={"rollout_node": 1})
        b = c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield {"cluster": c, "nodes": [a, b]}
    finally:
        c.shutdown()  # type: ignore[no-untyped-call]


@pytest.mark.timeout(600)
def test_fsdp2_ranks_over_two_nodes_equal_single_then_a_node_dies_and_resume(cluster: Any, tmp_path: Path) -> None:
    from posttrain.loop.training_loop import train
    from posttrain.loop.validate import load_run_config

    c = cluster["cluster"]
    ref_dir, run_dir, marker = tmp_path / "single", tmp_path / "ray", tmp_path / "kill"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(LOOP_TESTS))
        assert train(load_run_config("grpo", [*BASE, f"run_dir={ref_dir}"])).step == STEPS

    place = [f"system.ray.address={c.address}", "learner.strategy=fsdp2", "learner.world_size=2"]
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_ray_learner_run.py"), str(marker), "grpo", *BASE, *RAY, *place,
         f"run_dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    deadline = time.monotonic() + 400
    while not marker.with_suffix(".ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, _tail(proc.communicate()[0] or "")
        time.sleep(0.2)
    where = marker.with_suffix(".ready").read_text()  # "node <id prefix> (<ip>)"
    victim = next((n for n in cluster["nodes"] if where.startswith(f"node {n.node_id[:12]}")), None)
    assert victim is not None, f"learner rank 1 is not on a node of the cluster: {where!r} (ranks not on Ray?)"
    c.remove_node(victim, allow_graceful=False)
    t_kill = time.monotonic()
    marker.with_suffix(".go").write_text(victim.node_id)
    out = proc.communicate(timeout=300)[0]
    (tmp_path / "failed_run.log").write_text(out)
    waited = time.monotonic() - t_kill
    assert proc.returncode != 0, _tail(out)
    err = [ln for ln in out.splitlines() if "learner rank" in ln and ("died" in ln or "gone" in ln)]
    assert err and "learner rank 1" in err[-1] and victim.node_id[:12] in err[-1], _tail(out)
    assert waited < 90, waited  # bounded: Ray reports the actor dead; far below learner.rank_timeout_s

    # where the ranks ran: recorded once, in the first update's metrics
    first = next(m for m in _metrics(run_dir) if "grad_norm" in m)
    assert first["learner/nodes"] == 2.0 and first["learner/rank0_node"] != first["learner/rank1_node"], first
    # the weights went from rank 0's actor to the rollout worker directly (system.ray.weight_sync=direct)
    assert first["learner/published_buckets"] == first["learner/weight_buckets"] > 0, first
    _assert_equal_runs(run_dir, ref_dir, [1, 2, 3, 4], 4)

    # another placement (a new node C) and another world size (one rank): resume to the end
    c.add_node(num_cpus=1, resources={"rollout_node": 1})
    c.wait_for_nodes()
    res = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "train", "grpo", *BASE, *RAY, f"system.ray.address={c.address}",
         "learner.strategy=fsdp2", "learner.world_size=1", "resume=true", f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=400, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert _metrics(run_dir)[-1]["step"] == STEPS
    assert sorted(_grad_norms(run_dir)) == list(range(1, STEPS + 1))
    _assert_equal_runs(run_dir, ref_dir, list(range(1, STEPS + 1)), STEPS)
