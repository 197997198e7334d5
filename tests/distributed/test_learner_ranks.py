"""Learner ranks driven by the loop (``learner.strategy=ddp|fsdp2``): equality with the embedded
learner, a wrong reduction caught, a killed rank detected and resumed from (docs/distributed.md).

Tolerance. Every run here trains the float64 ``micro`` preset for 5 steps on the same prompts
(``flaky_task:digit_first``: a reward signal from a random init) with a k3 KL penalty in the loss
under the adaptive controller (reference log-probs and the coefficient cross to the ranks). A rank computes a token-balanced
share of each mini-batch, so its GEMMs have other shapes than the single process's; the shared
bound (tests/_tolerance.py) for results whose reductions span at most ``n`` = the longest sequence
is ``shape_rtol(n) = 4 n eps(float32)`` (float32: HF's attention softmax). Per-step metrics
(``grad_norm``, a global reduction of every rank's share) must agree within that; the weights after
5 AdamW steps are compared as whole updates (``update_rel_diff``) within ``100 * shape_rtol(n)``,
the bound ``test_distributed_learner.py`` uses for one AdamW update (Adam divides each gradient
element by its own ``sqrt(v)``, which amplifies rounding on near-zero elements). Measured on this
machine: ~2e-15 for both fsdp2 and ddp. The reduction bugs — one rank's share of the gradient
dropped, or FSDP's default MEAN instead of the SUM the global-count weights need — move the update
by ~0.9 and ~2e-3 (7x the bound) and ``grad_norm`` by ~0.3 and 0.5, far outside.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _tolerance import shape_rtol, update_rel_diff  # noqa: E402

from posttrain.learner.distributed import balanced_shards  # noqa: E402
from posttrain.learner.rank_process import fqn_to_id_optimizer_state, id_to_fqn_optimizer_state  # noqa: E402
from posttrain.learner.ranks import LearnerRankError  # noqa: E402
from posttrain.loop.validate import load_run_config  # noqa: E402

LOOP_TESTS = Path(__file__).resolve().parents[1] / "loop"  # flaky_task lives there
BASE = ["model.path=builtin:micro", "model.dtype=float64", "task.name=flaky_task:digit_first",
        "loss.kl_estimator=k3", "loss.kl_coef=0.05", "loss.kl_target=0.1",
        "task.kwargs={terms: 2}", "sampling.prompts_per_step=2", "sampling.group_size=4",
        "sampling.max_new_tokens=2", "eval.size=1", "eval.every=100", "logging.progress=false",
        "guards.max_truncation_rate=1.0", "optim.microbatch_tokens=24", "steps=5",
        "learner.startup_timeout_s=240", "learner.rank_timeout_s=120",
        "sft.steps=0", "optim.num_minibatches=1"]  # from the random init, one optimizer step (not the shipped grpo's)
# The sharded-checkpoint runs leave out the KL term: their steps 1-3 have zero advantages, so the
# gradient is exactly zero and AdamW takes no step before step 4 (the stateless-optimizer checkpoint at
# step 2) -- with a KL term that would hinge on pi_ref and pi_theta agreeing bit for bit, and they are
# computed in forwards of different shapes.
NO_KL = ["loss.kl_estimator=null", "loss.kl_coef=0.0", "loss.kl_target=null"]
_CACHE: dict[str, dict[str, Any]] = {}


@pytest.fixture(autouse=True)
def _plugin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(LOOP_TESTS))


def _final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "actor" / "model.safetensors"))


def _grad_norms(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "grad_norm" in m:
            out[int(m["step"])] = float(m["grad_norm"])
    return out


def _longest(run_dir: Path) -> int:
    from posttrain.trajectory import Ledger

    return max(len(t.token_ids) for t in Ledger(run_dir / "ledger").read_trajectories())


def _run(key: str, tmp_root: Path, overrides: list[str], monkeypatch: pytest.MonkeyPatch | None = None,
         **rank_overrides: Any) -> dict[str, Any]:
    """Train once per key (module cache); returns final weights, grad norms and the run dir."""
    if key in _CACHE:
        return _CACHE[key]
    import posttrain.loop.builders as builders
    from posttrain.loop.training_loop import train

    run_dir = tmp_root / key
    cfg = load_run_config("grpo", [*BASE, *overrides, f"run_dir={run_dir}"])
    if rank_overrides:
        assert monkeypatch is not None
        orig = builders.build_learner_ranks
        monkeypatch.setattr(builders, "build_learner_ranks", lambda c, m, **k: orig(c, m, **rank_overrides))
    st = train(cfg)
    assert st.step == 5
    _CACHE[key] = {"w": _final_weights(run_dir, 5), "gn": _grad_norms(run_dir), "dir": run_dir}
    return _CACHE[key]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ranks")


def _start() -> dict[str, torch.Tensor]:
    from posttrain.models import build_char_tokenizer, build_tiny_model

    return build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=0, dtype=torch.float64).state_dict()


def _compare(run: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float, float]:
    """(update_rel_diff, worst relative grad_norm difference, the rtol of the longest sequence)."""
    start = {k: v for k, v in _start().items() if k in ref["w"]}
    d = update_rel_diff(run["w"], ref["w"], start)
    assert sorted(run["gn"]) == sorted(ref["gn"])
    assert any(g > 0 for g in ref["gn"].values()), "the reference never had a gradient: nothing is compared"
    gn = max(abs(run["gn"][s] - g) / max(g, 1e-300) for s, g in ref["gn"].items() if g > 0)
    return d, gn, shape_rtol(_longest(ref["dir"]))


def _no_rank_processes_left() -> None:
    import multiprocessing as mp

    left = [p.name for p in mp.active_children() if p.name.startswith("posttrain-learner-rank")]
    assert not left, f"learner rank processes still alive: {left}"


# ---------------------------------------------------------------------- pure helpers
def test_balanced_shards_hand_computed_and_invariants() -> None:
    # lengths 9, 1, 5, 5, 3 over 2 ranks (LPT): 9 -> r0; 5 -> r1; 5 -> r1 (5 < 9); 3 -> r0 (9 < 10); 1 -> r1
    assert balanced_shards([10, 11, 12, 13, 14], [9, 1, 5, 5, 3], 2) == [[10, 14], [11, 12, 13]]
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, w = int(torch.randint(1, 20, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        lengths = torch.randint(1, 50, (n,), generator=g).tolist()
        rows = list(range(100, 100 + n))
        shards = balanced_shards(rows, lengths, w)
        assert sorted(r for s in shards for r in s) == rows  # every row exactly once
        load = [sum(lengths[r - 100] for r in s) for s in shards]
        assert max(load) <= sum(lengths) / w + max(lengths)  # LPT bound
        assert shards == balanced_shards(rows, lengths, w)  # deterministic: every rank agrees


def test_optimizer_state_formats_round_trip() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    sd = opt.state_dict()
    fqn = id_to_fqn_optimizer_state(sd, names)
    assert set(fqn["state"]) == set(names) and fqn["param_groups"][0]["params"] == names
    back = fqn_to_id_optimizer_state(fqn, names)
    assert back["param_groups"] == sd["param_groups"]
    for i, s in sd["state"].items():
        for k, v in s.items():
            assert torch.equal(back["state"][i][k], v)


# ---------------------------------------------------------------------- equality through the loop
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fsdp2_two_ranks_end_equal_to_single(mode: str, tmp_root: Path) -> None:
    ref = _run(f"single-{mode}", tmp_root, [f"system.mode={mode}"])
    run = _run(f"fsdp2-{mode}", tmp_root, [f"system.mode={mode}", "learner.strategy=fsdp2", "learner.world_size=2"])
    d, gn, rtol = _compare(run, ref)
    assert gn <= rtol, f"grad_norm differs by {gn:.3e} > {rtol:.3e}"
    assert d <= 100 * rtol, f"update differs by {d:.3e} > {100 * rtol:.3e}"
    _no_rank_processes_left()


def test_ddp_two_ranks_end_equal_to_single(tmp_root: Path) -> None:
    ref = _run("single-sync", tmp_root, ["system.mode=sync"])
    run = _run("ddp-sync", tmp_root, ["system.mode=sync", "learner.strategy=ddp", "learner.world_size=2"])
    d, gn, rtol = _compare(run, ref)
    assert gn <= rtol and d <= 100 * rtol, (d, gn, rtol)


@pytest.mark.parametrize("bug", [{"drop_rank": 1}, {"grad_divide_factor": 2.0}], ids=["rank-dropped", "mean-not-sum"])
def test_a_wrong_reduction_is_caught_by_the_same_tolerance(bug: dict[str, Any], tmp_root: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _run("single-sync", tmp_root, ["system.mode=sync"])
    key = "bug-" + "-".join(f"{k}{v}" for k, v in bug.items())
    run = _run(key, tmp_root, ["system.mode=sync", "learner.strategy=fsdp2", "learner.world_size=2"],
               monkeypatch, **bug)
    d, gn, rtol = _compare(run, ref)
    assert gn > rtol and d > 100 * rtol, (d, gn, rtol)


# ---------------------------------------------------------------------- faults and resume
def test_sigkilled_rank_fails_the_run_naming_it_then_resume_on_one_rank(tmp_root: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from posttrain.learner.ranks import LearnerRanks
    from posttrain.loop.training_loop import train

    run_dir = tmp_root / "killed"
    # No KL term (NO_KL, as the sharded-checkpoint runs): the ranks' pi_theta (an FSDP2-sharded head: the
    # full-logits path) and the driver's pi_ref (the chunked head) are forwards of different shapes, so
    # with a KL the zero-advantage steps 1-3 would get a rounding-level gradient on one side and AdamW
    # would start counting its steps there (a different bias correction at step 4) but not on the other.
    over = ["system.mode=sync", "checkpoint_every=2", f"run_dir={run_dir}", *NO_KL]
    cfg = load_run_config("grpo", [*BASE, *over, "learner.strategy=fsdp2", "learner.world_size=2"])
    orig = LearnerRanks.update
    seen: dict[str, Any] = {}

    def update(self: LearnerRanks, *a: Any, **k: Any) -> Any:
        if self.version == 2:  # the third update: SIGKILL rank 1 while it works
            pid = self.pids[1]
            threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
            seen["t_kill"] = time.monotonic()
        return orig(self, *a, **k)

    monkeypatch.setattr(LearnerRanks, "update", update)
    with pytest.raises(LearnerRankError) as e:
        train(cfg)
    waited = time.monotonic() - seen["t_kill"]
    msg = str(e.value)
    assert "\n" not in msg and "learner rank 1" in msg and "SIGKILL" in msg, msg
    # bounded: the liveness poll (0.5 s) finds it, far below rank_timeout_s (the other rank is stuck
    # in a collective with the dead one and would otherwise wait for the process-group timeout)
    assert waited < 120, waited
    _no_rank_processes_left()
    monkeypatch.setattr(LearnerRanks, "update", orig)
    # resume on ONE rank (2 -> 1; the learner section differs from config.yaml: resume_force)
    cfg = load_run_config("grpo", [*BASE, *over, "learner.strategy=fsdp2", "learner.world_size=1",
                               "resume=true", "resume_force=true"])
    st = train(cfg)
    assert st.step == 5
    _no_rank_processes_left()
    ref = _run("single-sync-nokl", tmp_root, ["system.mode=sync", *NO_KL])
    run = {"w": _final_weights(run_dir, 5), "gn": _grad_norms(run_dir), "dir": run_dir}
    d, gn, rtol = _compare(run, ref)
    # resumed from the step-2 checkpoint (optimizer state included) it ends where the uninterrupted run does
    assert gn <= rtol and d <= 100 * rtol, (d, gn, rtol)


def test_cli_fsdp2_float32_two_ranks(tmp_path: Path) -> None:
    """``posttrain train`` end to end with a float32 model (FSDP's float32 reduce-scatter must be a
    plain SUM collective: gloo has no PREMUL_SUM), a reward signal, and the ranks' metrics."""
    import subprocess

    run_dir = tmp_path / "cli"
    args = [a for a in BASE if not a.startswith(("model.dtype", "loss.kl", "steps"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LOOP_TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "train", "grpo", *args, "steps=4", "learner.strategy=fsdp2",
         "learner.world_size=2", f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=500, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "grad_norm" in m]
    assert len(steps) == 4 and all(m["learner/world_size"] == 2.0 for m in steps)
    assert any(m["grad_norm"] > 0 and m["optimizer_steps"] == 1.0 for m in steps)  # a real reduce-scatter ran
    assert _final_weights(run_dir, 4)["model.embed_tokens.weight"].dtype == torch.float32


# ---------------------------------------------------------------------- sharded checkpoints (DCP)
class _Interrupt(RuntimeError):
    pass


@pytest.fixture(scope="module")
def dcp_run(tmp_root: Path) -> Path:
    """A fsdp2 x 2 run stopped during its fifth update, with sharded (DCP) checkpoints at steps 2 (no
    optimizer step yet: a stateless AdamW) and 4 (after the first optimizer step, at step 4)."""
    from posttrain.learner.ranks import LearnerRanks
    from posttrain.loop.training_loop import train

    run_dir = tmp_root / "dcp"
    cfg = load_run_config("grpo", [*BASE, *NO_KL, "system.mode=sync", "checkpoint_every=2", f"run_dir={run_dir}",
                               "learner.strategy=fsdp2", "learner.world_size=2"])
    orig = LearnerRanks.update

    def update(self: LearnerRanks, *a: Any, **k: Any) -> Any:
        if self.version == 4:
            raise _Interrupt("stop after the step-4 checkpoint")
        return orig(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(_Interrupt):
        mp.syspath_prepend(str(LOOP_TESTS))
        mp.setattr(LearnerRanks, "update", update)
        train(cfg)
    _no_rank_processes_left()
    return run_dir


def _ck(run_dir: Path, step: int = 4) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def test_sharded_checkpoint_holds_per_rank_shards_and_no_full_optimizer_file(dcp_run: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    dcp_dir = _ck(dcp_run) / "learner_dcp"
    shards = sorted(p.name for p in dcp_dir.glob("*.distcp"))
    assert any(n.startswith("__0_") for n in shards) and any(n.startswith("__1_") for n in shards), shards
    manifest = json.loads((dcp_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["optimizer"] is True
    assert set(manifest["files"]) == {*shards, ".metadata"}
    ls = torch.load(_ck(dcp_run) / "learner_state.pt", weights_only=True)["learner"]
    assert "optimizer" not in ls and ls["optimizer_in_shards"] and ls["version"] == 4
    early = json.loads((_ck(dcp_run, 2) / "learner_dcp" / "manifest.json").read_text())
    assert early["optimizer"] is False  # no optimizer step before step 4: nothing to shard yet
    # where DCP put each optimizer tensor's bytes: both files hold a part, neither the whole
    md = FileSystemReader(str(dcp_dir)).read_metadata()
    per_file: dict[str, int] = {}
    files_of: dict[str, set[str]] = {}
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith("optim.state.") and idx.fqn.endswith(("exp_avg", "exp_avg_sq")):
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
            files_of.setdefault(idx.fqn, set()).add(info.relative_path)
    total = sum(per_file.values())
    assert len(per_file) == 2 and max(per_file.values()) < total, per_file
    emb = "optim.state.model.embed_tokens.weight.exp_avg"
    assert files_of[emb] == set(per_file), files_of.get(emb)  # a sharded tensor: half in each rank's file


@pytest.mark.parametrize(("target", "step"), [("fsdp2-x2", 4), ("ddp-x2", 4), ("single", 4), ("single", 2)])
def test_sharded_checkpoint_resumes_to_the_uninterrupted_weights(target: str, step: int, dcp_run: Path,
                                                                 tmp_root: Path) -> None:
    """Resume from the fsdp2 x 2 shards on 2 fsdp2 ranks, on 2 ddp ranks (full replicas: each reads
    both ranks' shards), and on the embedded learner (no process group) — the placement keys change
    without ``resume_force``. Step 4's
    shards hold AdamW state that step 5 uses; step 2's a stateless optimizer."""
    import shutil

    from posttrain.loop.training_loop import train

    run_dir = tmp_root / f"dcp-resume-{target}-{step}"
    shutil.copytree(dcp_run, run_dir)
    for later in (run_dir / "checkpoints").glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    strategy = target.split("-")[0]
    place = [f"learner.strategy={strategy}", f"learner.world_size={1 if strategy == 'single' else 2}"]
    cfg = load_run_config("grpo", [*BASE, *NO_KL, "system.mode=sync", "checkpoint_every=2", f"run_dir={run_dir}",
                               *place, "resume=true"])
    assert train(cfg).step == 5
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 5
    _no_rank_processes_left()
    ref = _run("single-sync-nokl", tmp_root, ["system.mode=sync", *NO_KL])
    run = {"w": _final_weights(run_dir, 5), "gn": _grad_norms(run_dir), "dir": run_dir}
    d, gn, rtol = _compare(run, ref)
    assert gn <= rtol and d <= 100 * rtol, (d, gn, rtol)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_shard_is_named_in_one_line(damage: str, dcp_run: Path, tmp_path: Path) -> None:
    import shutil

    from posttrain.learner.checkpoint import load_checkpoint
    from posttrain.loop.run_dir import RunDirError
    from posttrain.loop.training_loop import train

    run_dir = tmp_path / "run"
    shutil.copytree(dcp_run, run_dir)
    for later in sorted((run_dir / "checkpoints").glob("step_*"))[:-1]:
        shutil.rmtree(later)  # only the damaged checkpoint is left: nothing to fall back to
    victim = next(iter(sorted((_ck(run_dir) / "learner_dcp").glob("__1_*.distcp"))))
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-7]))
    else:
        victim.unlink()
    with pytest.raises(ValueError) as e:
        load_checkpoint(_ck(run_dir))
    msg = str(e.value)
    assert "\n" not in msg and str(victim) in msg, msg
    cfg = load_run_config("grpo", [*BASE, *NO_KL, "system.mode=sync", "checkpoint_every=2", f"run_dir={run_dir}",
                               "resume=true"])
    with pytest.raises(RunDirError) as e2:
        train(cfg)
    assert "\n" not in str(e2.value) and victim.name in str(e2.value), str(e2.value)


# ---------------------------------------------------------------------- weights streamed in buckets
def _buckets_per_step(run_dir: Path) -> list[float]:
    return [json.loads(line)["learner/weight_buckets"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "learner/weight_buckets" in json.loads(line)]


def test_bucket_plan_hand_computed_and_invariants() -> None:
    from posttrain.learner.rank_process import bucket_plan

    # bound 10: a(4) b(4) | c(6) | d(12: alone, larger than a bucket) | e(1) f(9)
    entries = [("a", 4), ("b", 4), ("c", 6), ("d", 12), ("e", 1), ("f", 9)]
    assert bucket_plan(entries, 10) == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        n, bound = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 100, (1,), generator=g))
        sizes = torch.randint(0, 60, (n,), generator=g).tolist()
        ents = [(f"t{i}", s) for i, s in enumerate(sizes)]
        plan = bucket_plan(ents, bound)
        assert [x for b in plan for x in b] == [e[0] for e in ents]  # every name once, in order
        size = dict(ents)
        assert all(sum(size[x] for x in b) <= bound or len(b) == 1 for b in plan)


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_weights_streamed_in_many_buckets_equal_one_bucket(strategy: str, tmp_root: Path) -> None:
    """The gather is exact, so the driver copy streamed in 23 buckets of 1 KiB ends bitwise equal to
    the one-bucket stream (the 0.1 MB micro model fits the default 64 MiB bucket: the whole state at once)."""
    one = _run(f"{strategy}-sync", tmp_root, ["system.mode=sync", f"learner.strategy={strategy}", "learner.world_size=2"])
    many = _run(f"{strategy}-buckets", tmp_root, ["system.mode=sync", f"learner.strategy={strategy}",
                                                  "learner.world_size=2", f"learner.weight_bucket_mb={1 / 1024}"])
    assert set(_buckets_per_step(one["dir"])) == {1.0}
    n = _buckets_per_step(many["dir"])
    assert len(n) == 5 and min(n) > 20, n
    assert set(one["w"]) == set(many["w"])
    for k, v in one["w"].items():
        assert torch.equal(v, many["w"][k]), k


def test_a_corrupted_weight_bucket_fails_the_run_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import posttrain.loop.builders as builders
    from posttrain.loop.training_loop import train

    orig = builders.build_learner_ranks
    monkeypatch.setattr(builders, "build_learner_ranks", lambda c, m, **k: orig(c, m, corrupt_bucket=3))
    cfg = load_run_config("grpo", [*BASE, "system.mode=sync", "learner.strategy=fsdp2", "learner.world_size=2",
                               f"learner.weight_bucket_mb={1 / 1024}", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(LearnerRankError) as e:
        train(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "weight bucket 3" in msg and "checksum mismatch" in msg, msg
    _no_rank_processes_left()


def test_an_embedded_learner_checkpoint_resumes_on_fsdp2_ranks(tmp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other direction: a full-state checkpoint of the embedded learner (id-keyed AdamW state in
    ``learner_state.pt``, no shards) resumes on fsdp2 x 2 without ``resume_force``."""
    from posttrain.learner.actor import PolicyLearner
    from posttrain.loop.training_loop import train

    run_dir = tmp_root / "embedded-then-fsdp2"
    over = ["system.mode=sync", "checkpoint_every=4", f"run_dir={run_dir}"]
    orig = PolicyLearner.update

    def update(self: PolicyLearner, *a: Any, **k: Any) -> Any:
        if self.version == 4:
            raise _Interrupt("stop after the step-4 checkpoint")
        return orig(self, *a, **k)

    monkeypatch.setattr(PolicyLearner, "update", update)
    with pytest.raises(_Interrupt):
        train(load_run_config("grpo", [*BASE, *over]))
    monkeypatch.setattr(PolicyLearner, "update", orig)
    assert not (_ck(run_dir) / "learner_dcp").exists()
    assert "optimizer" in torch.load(_ck(run_dir) / "learner_state.pt", weights_only=True)["learner"]
    cfg = load_run_config("grpo", [*BASE, *over, "learner.strategy=fsdp2", "learner.world_size=2", "resume=true"])
    assert train(cfg).step == 5
    _no_rank_processes_left()
    ref = _run("single-sync", tmp_root, ["system.mode=sync"])
    d, gn, rtol = _compare({"w": _final_weights(run_dir, 5), "gn": _grad_norms(run_dir), "dir": run_dir}, ref)
    assert gn <= rtol and d <= 100 * rtol, (d, gn, rtol)
