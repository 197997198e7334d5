"""Rollout + verification of one step: prompts from the data cursor, G samples each, scored.

With ``dynamic_sampling`` (DAPO) groups whose valid rewards are all equal carry no group signal
and are dropped; the stage draws more prompts until the batch holds ``prompts_per_step`` useful
groups or ``max_sampling_rounds`` is reached (the shortfall is reported, never hidden).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from posttrain.config import RunConfig
from posttrain.loop.scoring import ScoringSpec, score
from posttrain.trajectory import Status, Trajectory


@dataclasses.dataclass
class RolloutStage:
    """Draws prompts, generates, verifies; owns no model (the run passes its engine)."""

    run: Any
    prompts_per_step: int
    group_size: int
    sampling: Any  # posttrain.rollout.SamplingParams
    spec: ScoringSpec
    dynamic_sampling: bool
    max_rounds: int

    @classmethod
    def from_config(cls, cfg: RunConfig, run: Any) -> RolloutStage:
        from posttrain.rollout.sampling import SamplingParams

        s = cfg.sampling
        params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens, n=s.group_size
        )
        spec = ScoringSpec(cfg.reward.weights, cfg.reward.overlong_max_len, cfg.reward.overlong_cache_len)
        return cls(run, s.prompts_per_step, s.group_size, params, spec, s.dynamic_sampling, s.max_sampling_rounds)

    def _round(self, step: int, n_prompts: int, round_idx: int) -> tuple[list[Trajectory], float, float]:
        from posttrain.rollout.types import GenerationRequest

        run = self.run
        examples = run.next_prompts(n_prompts)
        seed = run.cfg.seed * 1_000_003 + step * 101 + round_idx
        reqs = [
            GenerationRequest(
                request_id=f"s{step}r{round_idx}p{i}-{ex.prompt_id}",
                prompt_ids=run.tokenizer(ex.prompt).input_ids,
                params=dataclasses.replace(self.sampling, seed=seed + i),
            )
            for i, ex in enumerate(examples)
        ]
        t0 = time.perf_counter()
        comps = run.engine.generate(reqs)
        t_roll = time.perf_counter() - t0
        per = {r.request_id: ex for r, ex in zip(reqs, examples, strict=True)}
        exs = [per[c.request_id] for c in comps]
        gids = [f"{c.request_id}" for c in comps]
        trajs, info = score(comps, exs, task=run.task, tokenizer=run.tokenizer, spec=self.spec,
                            group_ids=gids, step=step * 100 + round_idx, verify_batch=run.verify_batch)
        return trajs, t_roll, info["time/reward_s"]

    def collect(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Trajectories of one step plus rollout metrics (time split, dynamic-sampling counts)."""
        kept: list[Trajectory] = []
        t_roll = t_rew = 0.0
        dropped = rounds = 0
        need = self.prompts_per_step
        while rounds < (self.max_rounds if self.dynamic_sampling else 1):
            trajs, a, b = self._round(step, need if not kept else max(need, 1), rounds)
            t_roll, t_rew, rounds = t_roll + a, t_rew + b, rounds + 1
            if not self.dynamic_sampling:
                kept = trajs
                break
            groups: dict[str, list[Trajectory]] = {}
            for t in trajs:
                groups.setdefault(t.group_id, []).append(t)
            for g in groups.values():
                rewards = {t.reward.total for t in g if t.status is not Status.INFRA_ERROR}
                if len(rewards) > 1 and len({t.group_id for t in kept}) < self.prompts_per_step:
                    kept.extend(g)
                else:
                    dropped += 1
            need = self.prompts_per_step - len({t.group_id for t in kept})
            if need <= 0:
                break
        info = {"time/rollout_s": t_roll, "time/reward_s": t_rew, "sampling/rounds": float(rounds)}
        if self.dynamic_sampling:
            info["sampling/dropped_groups"] = float(dropped)
            info["sampling/shortfall_groups"] = float(max(need, 0))
        return kept, info
