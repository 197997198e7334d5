"""``posttrain check`` for ``trainer: preference`` with ``preference.online``: the rollout checks on sampled
groups and the preference checks on the pairs they give."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from posttrain.commands.check_result import CheckResult
from posttrain.commands.check_rollout import check_behavior_vs_old, check_save_resume, sample_trajectories
from posttrain.loop.preference_batch import EncodedPair

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.trajectory import Trajectory


def sampled_pairs(trajectories: Sequence[Trajectory]) -> list[EncodedPair]:
    """Per group, its first two responses with action tokens as a (first, second) pair, whatever their
    verdicts: the preference checks' invariants (zero margin at the start, masking, micro-batch splits)
    hold for any pair, so they run even when no group mixes correct and wrong responses."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        if t.num_actions > 0:
            groups.setdefault(t.group_id, []).append(t)
    out = []
    for gid, (a, b, *_) in ((g, m) for g, m in groups.items() if len(m) >= 2):
        first = int(np.argmax(a.action_mask.astype(bool)))
        out.append(EncodedPair(pair_id=f"{a.traj_id}>{b.traj_id}", prompt=tuple(int(x) for x in a.token_ids[:first]),
                               chosen=tuple(int(x) for x in a.token_ids[a.action_mask.astype(bool)]),
                               rejected=tuple(int(x) for x in b.token_ids[b.action_mask.astype(bool)]),
                               score_diff=0.0, source=f"group {gid}"))
    return out


def online_preference_checks(cfg: RunConfig, prompts: int = 4) -> list[CheckResult]:
    """``trainer: preference`` with ``preference.online``: the rollout checks ``behavior_vs_old`` and
    ``save_resume`` on ``prompts`` sampled groups, then the preference checks of
    :mod:`posttrain.commands.check_preference` on the pairs those groups give
    (:func:`~posttrain.loop.online_preference.group_pairs`), which replace the RL policy-loss checks (the
    run trains with the preference loss, not a policy-gradient one). Where the groups give fewer than two
    (correct, wrong) pairs (an untrained model, all wrong) the pairs are :func:`sampled_pairs`; fewer than two
    of those leave the three ``n/a``, saying so."""
    from posttrain.commands.check_preference import pair_checks
    from posttrain.loop.builders import build_engine, build_model, build_policy_learner, build_task
    from posttrain.loop.online_preference import group_pairs
    from posttrain.loop.preference_loss import uses_reference
    from posttrain.trajectory import collate

    torch.manual_seed(cfg.seed)
    tok, model = build_model(cfg)
    learner = build_policy_learner(cfg, model)
    trajs = sample_trajectories(cfg, prompts, tok, model, build_task(cfg), build_engine(learner.model, tok))
    batch = collate(trajs, pad_token_id=int(tok.pad_token_id or 0))
    old = learner.compute_logprobs(batch)
    results = [check_behavior_vs_old(batch, old, cfg)]
    pairs = group_pairs(trajs, cfg.preference.pairs_per_group)
    source = f"{len(pairs)} (correct, wrong) pairs of the sampled groups"
    if len(pairs) < 2:  # the invariants do not depend on which response is preferred: any two of a group
        pairs = sampled_pairs(trajs)
        source = f"{len(pairs)} pairs of two sampled responses of a group (no group mixed correct and wrong)"
    names = ("reference_equals_policy", "mask_invariance", "microbatch_split")
    if len(pairs) < 2:
        why = f"the {prompts} sampled groups gave {len(pairs)} pair(s) of responses, need 2; raise --prompts"
        results += [(n, None, why) for n in names]
    else:
        policy = learner.model.eval()
        ref = copy.deepcopy(policy).requires_grad_(False) if uses_reference(cfg.preference.loss) else None
        results += [(n, ok, f"{detail} [{source}]") for n, ok, detail in
                    pair_checks(policy, ref, pairs, cfg, int(tok.pad_token_id or 0))]
    results.append(check_save_resume(cfg, learner, tok, batch, old))
    return results
