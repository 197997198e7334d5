"""Weight sync time, learner ranks -> rollout workers on Ray: direct (the ranks publish) vs via the driver.

For each model, ``--ranks`` learner rank actors (``--strategy``, as ``posttrain train`` builds them
with ``system.backend=ray``) and ``--workers`` Ray rollout workers (the builtin engine) run on a local
Ray session, once per ``system.ray.weight_sync`` path: ``via_driver`` (the buckets stream to the
driver, which packs its copy into one packet for the workers) and ``direct`` (rank 0's actor puts each
bucket in the object store; the workers fetch and verify them themselves). Each repeat is one update
on a tiny batch (2 rows of 8 tokens) followed by the loop's sync (``engine.update_weights(learner.
weights_for_rollout())``); one untimed warm-up first. Per repeat:

- ``stream_s``: ranks -> driver copy (``time/learner_weight_stream_s``: first bucket in, last loaded);
- ``engine_s``: the engine sync call (via_driver: pack + put + every worker fetches, verifies, loads;
  direct: references out, every worker fetches, verifies, loads);
- ``sync_s`` = stream_s + engine_s, the time from the ranks' weights to every engine's; ``update_s``:
  the whole update call (compute + stream);
- ``sent_bytes`` / ``buckets``: what each worker receives per sync (direct: rank 0's buckets, a tied
  weight once; via_driver: one packet of the driver's state dict, a tied weight under each name).

Medians and spreads (min, max) per model and path, and the via_driver / direct ratio of the median
``sync_s``. Timings: run it on a quiet machine; on a loaded one only the ratio means much (the load
average is printed and written with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import TypedDict

PATHS = ("via_driver", "direct")
PHASES = ("sync_s", "stream_s", "engine_s", "update_s")


class Repeat(TypedDict):
    """One timed update + sync."""

    sync_s: float
    stream_s: float
    engine_s: float
    update_s: float


class Row(TypedDict):
    """One model on one path: its repeats and their summary (``median`` / ``min`` / ``max`` per phase)."""

    model: str
    path: str
    sent_bytes: int
    buckets: int
    repeats: list[Repeat]
    median: dict[str, float]
    min: dict[str, float]
    max: dict[str, float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``posttrain bench weight-sync``."""
    parser.add_argument("--models", default="builtin:25m,builtin:smollm2-135m-instruct",
                        help="comma-separated model paths (default: the 25M tiny model and SmolLM2-135M)")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated from via_driver, direct")
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs per model and path (after one warm-up)")
    parser.add_argument("--ranks", type=int, default=2, help="learner rank actors")
    parser.add_argument("--workers", type=int, default=2, help="Ray rollout workers")
    parser.add_argument("--strategy", default="fsdp2", choices=("fsdp2", "ddp"), help="learner.strategy")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="learner.weight_bucket_mb")
    parser.add_argument("--num-cpus", type=int, default=None,
                        help="logical CPUs of the local Ray session (default: enough for every actor)")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _summary(repeats: list[Repeat]) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """``(median, min, max)`` of every phase over ``repeats``."""
    cols = {p: [float(r[p]) for r in repeats] for p in PHASES}  # type: ignore[literal-required]
    return ({p: statistics.median(v) for p, v in cols.items()}, {p: min(v) for p, v in cols.items()},
            {p: max(v) for p, v in cols.items()})


def _measure(model_path: str, path: str, args: argparse.Namespace) -> Row:
    """Build ranks + workers for one model on one path, one warm-up, ``args.repeats`` timed syncs."""
    import torch

    from posttrain.loop.backends import builtin_engine_factory
    from posttrain.loop.backends.ray_rollout import RayRolloutWorkers
    from posttrain.loop.builders import build_learner_ranks, build_model
    from posttrain.loop.validate import load_run_config
    from posttrain.rollout.weight_transfer import PublishedWeights
    from posttrain.trajectory.collate import collate
    from posttrain.trajectory.record import make_trajectory

    cfg = load_run_config("grpo", [
        f"model.path={model_path}", "model.dtype=float32", f"learner.strategy={args.strategy}",
        f"learner.world_size={args.ranks}", "learner.device=cpu", f"learner.weight_bucket_mb={args.bucket_mb}",
        "learner.startup_timeout_s=900", "learner.rank_timeout_s=900", "system.backend=ray",
        f"system.ray.weight_sync={path}", f"system.ray.num_rollout_workers={args.workers}",
        "system.ray.num_reward_workers=0", "system.ray.transfer_timeout_s=600", "system.ray.startup_timeout_s=900",
        "loss.kl_estimator=null", "loss.kl_coef=0.0", "loss.kl_target=null", "optim.num_minibatches=1",
    ])
    tok, model = build_model(cfg)
    vocab = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    g = torch.Generator().manual_seed(0)
    trajs = [make_trajectory(traj_id=f"t{i}", prompt_id="p0", group_id="g0",
                             prompt_ids=torch.randint(3, vocab, (4,), generator=g).tolist(),
                             action_ids=torch.randint(3, vocab, (4,), generator=g).tolist(),
                             action_logprobs=[-2.0] * 4, action_versions=0, finish="terminal") for i in range(2)]
    batch = collate(trajs, pad_token_id=int(tok.pad_token_id or 0))
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    factory = builtin_engine_factory(model, eos_token_id=tok.eos_token_id, pad_token_id=int(tok.pad_token_id or 0))
    workers = RayRolloutWorkers(factory, cfg.system.ray)
    ranks = build_learner_ranks(cfg, model)
    repeats: list[Repeat] = []
    try:
        old = ranks.compute_logprobs(batch)
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            m = ranks.update(batch, adv, old_logprob=old).metrics
            t1 = time.perf_counter()
            sent = ranks.weights_for_rollout()
            workers.update_weights(sent, version=ranks.version)
            t2 = time.perf_counter()
            if i:  # the first is the warm-up
                stream = float(m["time/learner_weight_stream_s"])
                repeats.append({"sync_s": stream + t2 - t1, "stream_s": stream, "engine_s": t2 - t1,
                                "update_s": t1 - t0})
        # what each worker receives: rank 0's buckets (a tied weight once), or the driver's packed state dict
        # (every name, a tied weight under each)
        buckets = len(sent.buckets) if isinstance(sent, PublishedWeights) else 1
        sent_bytes = (sum(b.nbytes for b in sent.buckets) if isinstance(sent, PublishedWeights)
                      else sum(t.numel() * t.element_size() for t in sent.values()))
    finally:
        ranks.close()
        workers.close()
    med, lo, hi = _summary(repeats)
    return {"model": model_path, "path": path, "sent_bytes": sent_bytes, "buckets": buckets, "repeats": repeats,
            "median": med, "min": lo, "max": hi}


def run(args: argparse.Namespace) -> int:
    """Every model x path on one local Ray session; print the table and the ratios (``--json`` too)."""
    from posttrain.config.ray import RayBackendConfig
    from posttrain.loop.backends.ray_cluster import init_ray, require_ray

    paths = _csv(args.paths)
    if not paths or any(p not in PATHS for p in paths) or args.repeats < 1 or args.ranks < 1 or args.workers < 1:
        raise ValueError(f"bench weight-sync: need --paths from {', '.join(PATHS)} (got {paths}) and --repeats, "
                         "--ranks, --workers >= 1")
    # every actor reserves 0.5 logical CPU (system.ray defaults): room for all of them, whatever the cores
    started = init_ray(RayBackendConfig(local_num_cpus=args.num_cpus or max(2, args.ranks + args.workers)))
    rows: list[Row] = []
    print(f"{'model':<32} {'path':<10} {'sent MB':>7} {'packets':>7} {'sync s (median [min, max])':>28} "
          f"{'stream s':>9} {'engine s':>9} {'update s':>9}", flush=True)
    try:
        for model_path in _csv(args.models):
            for path in paths:
                r = _measure(model_path, path, args)
                rows.append(r)
                med = r["median"]
                print(f"{model_path:<32} {path:<10} {r['sent_bytes'] / 1e6:>7.0f} {r['buckets']:>7} "
                      f"{med['sync_s']:>10.3f} [{r['min']['sync_s']:.3f}, {r['max']['sync_s']:.3f}]"
                      f"{'':>3}{med['stream_s']:>9.3f} {med['engine_s']:>9.3f} {med['update_s']:>9.3f}", flush=True)
    finally:
        if started:
            require_ray().shutdown()
    ratios: dict[str, float] = {}
    for model_path in _csv(args.models):
        by = {r["path"]: r["median"]["sync_s"] for r in rows if r["model"] == model_path}
        if len(by) == 2 and by["direct"] > 0:
            ratios[model_path] = by["via_driver"] / by["direct"]
            print(f"{model_path}: via_driver / direct median sync time = {ratios[model_path]:.2f}x")
    load = os.getloadavg()[0]
    print(f"(load average {load:.1f}; {args.ranks} {args.strategy} ranks, {args.workers} workers, "
          f"{args.repeats} repeats after one warm-up)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "loadavg_1m": load, "cpu_count": os.cpu_count(), "strategy": args.strategy, "ranks": args.ranks,
            "workers": args.workers, "repeats": args.repeats, "bucket_mb": args.bucket_mb, "rows": rows,
            "via_driver_over_direct": ratios}, indent=2))
    return 0
