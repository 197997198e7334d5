"""The shared-prompt forward (``optim.share_prompts``): each distinct prompt forwarded once, the same log-probs,
entropies and gradients as the padded forward up to float rounding, fewer tokens through the model."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.learner import shared_prompt
from posttrain.learner.actor import PolicyLearner
from posttrain.learner.logprobs import FullLogits, forward_logprobs, linear_head_of
from posttrain.learner.microbatch import microbatches
from posttrain.learner.settings import ComputeSettings
from posttrain.learner.shared_prompt import (
    _expanded_cache,
    _layer_states,
    bucketed_tokens,
    length_buckets,
    prompt_groups,
    shared_prompt_logprobs,
    shared_prompt_microbatches,
)
from posttrain.trajectory import collate, make_trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_grads_close, assert_scaled_close, scaled_maxdiff, shape_rtol  # noqa: E402

KW = dict(policy_loss="ppo_clip", policy_loss_kwargs={"eps_low": 0.2, "eps_high": 0.28},
          reduction="seq_mean_token_mean", microbatch_tokens=64)


def grouped_batch(prompts: int = 5, group: int = 4, seed: int = 1):
    """``prompts`` prompts of 2..7 tokens (prompt 1 is prompt 0 plus one token: a prefix is not a match), each
    answered ``group`` times with 1..6 action tokens; rows of a group are adjacent except the last prompt's,
    which are interleaved with the others'."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(3, 106, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(prompts)]
    base[1] = base[0] + [7]
    rows = []
    for p, prompt in enumerate(base):
        for i in range(group):
            a = int(torch.randint(1, 7, (1,), generator=g))
            acts = torch.randint(3, 106, (a,), generator=g).tolist()
            beh = (-torch.rand(a, generator=g, dtype=torch.float64) * 3 - 0.1).tolist()
            rows.append(make_trajectory(traj_id=f"t{p}.{i}", prompt_id=f"p{p}", group_id=f"g{p}", prompt_ids=prompt,
                                        action_ids=acts, action_logprobs=beh, action_versions=0, finish="terminal"))
    last = rows[-group:]
    rows = rows[:-group]
    for i, r in enumerate(last):  # interleave the last group: grouping reads ids, not adjacency
        rows.insert(2 * i + 1, r)
    return collate(rows, pad_token_id=0), base


def _micro(seed: int = 0) -> torch.nn.Module:
    from posttrain.models import build_tiny_model

    return build_tiny_model("micro", seed=seed).to(torch.float64).eval()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=110, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def test_prompt_groups_by_ids_not_adjacency_or_prefix():
    batch, base = grouped_batch()
    pg = prompt_groups(batch.input_ids, batch.attention_mask, batch.action_mask)
    assert pg.num_prompts == len(base)
    prompt_of = [batch.input_ids[f, :int(pg.prompt_len[f])].tolist() for f in pg.first.tolist()]
    assert sorted(prompt_of) == sorted(base)  # one group per distinct prompt, numbered by first appearance
    for b in range(batch.size):
        p = int(pg.prompt_len[b])
        assert batch.input_ids[b, :p].tolist() == prompt_of[int(pg.group[b])]
        assert batch.action_mask[b, p] == 1 and batch.action_mask[b, :p].sum() == 0
    assert sorted(torch.bincount(pg.group).tolist()) == [4] * len(base)
    # hand-built: rows 0 and 2 share [5, 6]; row 1's [5, 6, 7] holds it as a prefix only; row 3 has no action,
    # so it is all prompt: [5, 6] again
    ids = torch.tensor([[5, 6, 9, 0], [5, 6, 7, 9], [5, 6, 8, 8], [5, 6, 0, 0]])
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    act = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 1, 1], [0, 0, 0, 0]])
    pg = prompt_groups(ids, am, act)
    assert pg.group.tolist() == [0, 1, 0, 0] and pg.first.tolist() == [0, 1]
    assert pg.prompt_len.tolist() == [2, 3, 2, 2] and pg.length.tolist() == [3, 4, 4, 2]


@pytest.mark.parametrize("build", [_micro, _llama], ids=["qwen2", "llama"])
@pytest.mark.parametrize("replay", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)],
                         ids=["plain", "truncated"])
@pytest.mark.parametrize("overhead", [32, 0], ids=["one_bucket", "a_bucket_per_length"])
def test_logprobs_entropy_and_gradients_equal_the_padded_forward(build, replay, overhead, monkeypatch):
    """With overhead 0 every response length runs as its own bucket (its own forward against its rows' cache
    copies); with 32 these responses of 1-6 tokens run as one."""
    monkeypatch.setattr(shared_prompt, "BUCKET_OVERHEAD_TOKENS", overhead)
    batch, _ = grouped_batch()
    resp = (batch.lengths - prompt_groups(batch.input_ids, batch.attention_mask, batch.action_mask).prompt_len)
    assert len(length_buckets(resp.tolist())) == (1 if overhead else len(set(resp.tolist())))
    act = batch.action_mask.to(torch.float64)
    w = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * act
    res = {}
    for shared in (False, True):
        model = build()
        if shared:
            lp, ent = shared_prompt_logprobs(linear_head_of(model), batch.input_ids, batch.attention_mask,
                                             batch.action_mask, with_entropy=True, **replay)
        else:
            lp, ent = forward_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True, **replay)
        ((lp * w).sum() + (ent * act).sum()).backward()
        res[shared] = (lp * act, ent * act, {n: p.grad.clone() for n, p in model.named_parameters()})
    rtol = shape_rtol(int(batch.lengths.max()))
    assert float(res[False][0].detach().abs().max()) > 1.0
    assert_scaled_close(res[True][0], res[False][0], rtol, msg="log-probs")
    assert_scaled_close(res[True][1], res[False][1], rtol, msg="entropy")
    assert_grads_close(res[True][2], res[False][2], rtol, msg="gradients")
    # nothing scored off the actions
    assert float((lp.detach() * (1 - act)).abs().max()) == 0.0


def test_tolerance_catches_a_response_scored_against_another_prompt():
    """The bug the equality guards against: a row's response run against a wrong prompt cache (one prompt
    token differs) moves its log-probs by far more than the tolerance."""
    batch, _ = grouped_batch()
    model = _micro()
    head = linear_head_of(model)
    lp, _ = shared_prompt_logprobs(head, batch.input_ids, batch.attention_mask, batch.action_mask)
    wrong = batch.input_ids.clone()
    wrong[0, 0] = 100 if int(wrong[0, 0]) != 100 else 101
    lp_wrong, _ = forward_logprobs(model, wrong, batch.attention_mask)
    act = batch.action_mask.to(torch.float64)
    assert scaled_maxdiff(lp_wrong[:1] * act[:1], lp[:1] * act[:1]) > 100 * shape_rtol(int(batch.lengths.max()))


def _tokens_through(model: torch.nn.Module, fn) -> int:
    n = [0]
    h = model.get_input_embeddings().register_forward_hook(lambda m, i, o: n.__setitem__(0, n[0] + i[0].numel()))
    try:
        fn()
    finally:
        h.remove()
    return n[0]


@pytest.mark.parametrize("overhead", [32, 0])
def test_the_update_equals_the_padded_update_with_fewer_tokens(make_advantages, overhead, monkeypatch):
    monkeypatch.setattr(shared_prompt, "BUCKET_OVERHEAD_TOKENS", overhead)
    batch, base = grouped_batch(prompts=6, group=4)
    adv = make_advantages(batch)
    res, tokens = {}, {}
    old = batch.behavior_logprob * batch.action_mask
    for shared in (False, True):
        learner = PolicyLearner(_micro(), lr=1e-2, compute=ComputeSettings(share_prompts=shared),
                                **{**KW, "microbatch_tokens": 200})
        assert learner.forward_context().share_prompts is shared
        tokens[shared] = _tokens_through(learner.model, lambda lr=learner, s=shared: res.__setitem__(
            s, lr.compute_gradients(batch, adv, old_logprob=old)))
    (l0, g0), (l1, g1) = res[False], res[True]
    rtol = shape_rtol(int(batch.lengths.max()))
    assert l1 == pytest.approx(l0, rel=rtol, abs=1e-12)
    assert_grads_close(g1, g0, rtol, msg="shared vs padded")
    # per micro-batch: U * P_max prompt tokens + n * (C_max - 1) response tokens of each length bucket, against
    # B * T_max padded; one bucket is the bound B * (C_max - 1)
    tensors = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "action_mask": batch.action_mask}
    expect_shared = expect_padded = one_bucket = 0
    for mb in shared_prompt_microbatches(tensors, list(range(batch.size)), 200):
        pg = prompt_groups(mb["input_ids"], mb["attention_mask"], mb["action_mask"])
        P, resp = int(pg.prompt_len.max()), (pg.length - pg.prompt_len).tolist()
        C = max(resp)
        expect_shared += pg.num_prompts * P
        one_bucket += pg.num_prompts * P + len(resp) * (C - 1)
        if overhead == 0:  # a bucket per distinct length: each row padded to its own length
            expect_shared += sum(c - 1 for c in resp if c > 1)
        else:  # the least-cost buckets (test_length_buckets_are_the_least_cost_partition)
            expect_shared += sum(len(b) * (max(resp[i] for i in b) - 1) for b in length_buckets(resp))
    for mb in microbatches(tensors, list(range(batch.size)), 200):
        expect_padded += mb["input_ids"].numel()
    assert (tokens[True], tokens[False]) == (expect_shared, expect_padded)
    assert tokens[True] < 0.75 * tokens[False]
    assert tokens[True] < one_bucket


def test_refused_without_a_linear_head_or_with_checkpointing():
    with pytest.raises(ValueError, match="share_prompts.*linear LM head"):
        PolicyLearner(FullLogits(_micro()), lr=1e-3, compute=ComputeSettings(share_prompts=True), **KW)
    with pytest.raises(ValueError, match="gradient checkpointing"):
        ComputeSettings(share_prompts=True, gradient_checkpointing=True)


@pytest.mark.parametrize("overrides, match", [
    (["optim.share_prompts=true", "optim.gradient_checkpointing=true"], "share_prompts.*gradient_checkpointing"),
    (["optim.share_prompts=true", "learner.strategy=fsdp2", "learner.world_size=2"], "share_prompts.*fsdp2"),
])
def test_config_refuses_what_cannot_take_effect(overrides, match):
    from posttrain.loop.validate import load_run_config

    with pytest.raises(Exception, match=match):
        load_run_config("demo", overrides)
    assert load_run_config("demo", ["optim.share_prompts=true"]).optim.share_prompts is True


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [None, 1, 20, 45, 120])
def test_shared_prompt_microbatches_keep_groups_whole_within_the_budget(seed, budget):
    batch, _ = grouped_batch(prompts=5, group=4, seed=seed)
    tensors = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "action_mask": batch.action_mask}
    rows = [r for r in range(batch.size) if r % 7 != 3]  # a mini-batch: some rows left out
    mbs = shared_prompt_microbatches(tensors, rows, budget)
    assert sorted(r for mb in mbs for r in mb.rows) == rows
    pg = prompt_groups(batch.input_ids, batch.attention_mask, batch.action_mask)
    plen, resp = pg.prompt_len, pg.length - pg.prompt_len
    for mb in mbs:
        assert mb["input_ids"].shape == (len(mb.rows), int(pg.length[mb.rows].max()))
        assert torch.equal(mb["input_ids"], batch.input_ids[mb.rows, : mb["input_ids"].shape[1]])
        groups = {int(pg.group[r]) for r in mb.rows}
        cost = len(groups) * int(plen[mb.rows].max()) + bucketed_tokens(resp[mb.rows].tolist())
        if budget is None:
            assert len(mbs) == 1
        elif len(groups) > 1:  # several groups share a pass only within the budget
            assert cost <= budget
        for u in groups:  # a group that fits alone is never split
            members = [r for r in rows if int(pg.group[r]) == u]
            alone = int(plen[members[0]]) + bucketed_tokens(resp[members].tolist())
            if budget is None or alone <= budget:
                assert set(members) <= set(mb.rows)


def test_the_expanded_cache_holds_each_rows_prompt_states():
    """Row b of the responses' cache is row group[b] of the prompts' cache, every layer (the cache a response runs
    against; a cache built empty would silently score responses without their prompt)."""
    model = _micro()
    head = linear_head_of(model)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = head.backbone(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    group = torch.tensor([1, 0, 1, 1])
    big = _layer_states(_expanded_cache(cache, group))
    small = _layer_states(cache)
    assert len(big) == len(small) == model.config.num_hidden_layers
    for (k, v), (k0, v0) in zip(big, small, strict=True):
        assert torch.equal(k, k0[group]) and torch.equal(v, v0[group])


def _brute_force_cost(lengths: list[int], overhead: int) -> int:
    """The least ``sum_k (|k| * max_k + overhead)`` over every cut of the length-sorted rows into runs."""
    order = sorted(lengths, reverse=True)
    best = None
    for mask in range(1 << max(len(order) - 1, 0)):
        cost, start = 0, 0
        for k in range(1, len(order) + 1):
            if k == len(order) or mask >> (k - 1) & 1:
                cost += (k - start) * order[start] + overhead
                start = k
        best = cost if best is None else min(best, cost)
    return best if best is not None else 0


def test_length_buckets_by_hand():
    assert length_buckets([]) == []
    assert length_buckets([3, 3, 3], 0) == [[0, 1, 2]]  # equal lengths never split
    # 128 + 127 padded together (1 token wasted) and 41 + 40 (1 wasted): two buckets beat one (2 * 87 wasted) at 32
    assert length_buckets([128, 40, 41, 127], 32) == [[0, 3], [2, 1]]
    assert length_buckets([128, 40, 41, 127], 0) == [[0], [3], [2], [1]]
    assert length_buckets([128, 40, 41, 127], 200) == [[0, 3, 2, 1]]  # one more forward costs more than it saves
    assert bucketed_tokens([128, 40, 41, 127], 32) == 2 * 128 + 2 * 41
    with pytest.raises(ValueError, match="overhead"):
        length_buckets([1], -1)


@pytest.mark.parametrize("seed", range(40))
def test_length_buckets_are_the_least_cost_partition(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 30, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
    overhead = [0, 1, 7, 32][seed % 4]
    buckets = length_buckets(lengths, overhead)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    order = [i for b in buckets for i in b]
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    cost = sum(len(b) * max(lengths[i] for i in b) + overhead for b in buckets)
    assert cost == _brute_force_cost(lengths, overhead)
