"""The shared-prompt forward: each distinct prompt of a micro-batch through the model once, its keys and values
reused by every response that follows it (``optim.share_prompts``).

A GRPO group's ``G`` samples repeat one prompt; the padded forward runs it ``G`` times. In a causal
transformer (Vaswani et al. 2017) a response position sees its prompt only through the prompt's keys and values
at each layer, and the prompt's own states never see the response. So the ``U`` distinct prompts are forwarded
once (``[U, P]``, right-padded, their cache kept with its graph), each row's cache is a row-copy of its prompt's
(``index_select``: the backward sums every response's gradient into the one prompt forward), and the ``B``
responses run against it (``[B, C]``, position ids continuing from each row's prompt length, the prompt's
padding masked out). Every log-prob and gradient is that of the padded forward, up to the float rounding of an
attention reduction over a different key layout. This is the shared-prefix forward of Prefix Grouper (Liu et
al. 2025, arXiv:2506.05433), here through the model's own KV cache rather than a rewritten attention.

Fewer tokens go through the projections and MLPs: ``U * P + sum_b C_b`` instead of ``B * (P + C)`` padded. The
responses run in length buckets (:func:`length_buckets`): rows sorted by response length, each bucket padded only
to its own longest, all against row-copies of the one prompt cache, so a group of responses of 40 to 128 tokens
is not padded to 128 throughout. Attention still runs once per row and head. Needs a model split at a linear LM
head (:func:`linear_head_of`), since the head runs on the gathered hidden states, and the model's cache (no
gradient checkpointing: a checkpointed forward in train mode turns the cache off).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence

import numpy as np
import torch

from posttrain.learner.chunked_head import chunk_tokens_for, chunked_token_logprobs
from posttrain.learner.logprobs import HEAD_IS_LM_HEAD_OF_LAST_HIDDEN, LinearHead, linear_head_of
from posttrain.learner.microbatch import Microbatch, RowTensors, take_rows


@dataclasses.dataclass(frozen=True)
class PromptGroups:
    """Rows grouped by their prompt: ``group[b]`` the index of row ``b``'s prompt among the ``U`` distinct ones,
    ``first[u]`` the first row holding prompt ``u``, ``prompt_len[b]`` row ``b``'s prompt length (its first action
    column; the whole row when it has no action token), ``length[b]`` its real length (attention-mask sum)."""

    group: torch.Tensor
    first: torch.Tensor
    prompt_len: torch.Tensor
    length: torch.Tensor

    @property
    def num_prompts(self) -> int:
        """``U``: distinct prompts."""
        return int(self.first.shape[0])


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor) -> PromptGroups:
    """Group the rows of ``[B, T]`` right-padded tensors by prompt: two rows share a prompt when their token ids
    before their first action token are equal (equal length and equal ids; a group id is never trusted).

    Contract: a row's prompt is columns ``0 .. p - 1`` with ``p`` its first action column, at least 1 (column 0
    has no context to be scored from); a row without an action token is all prompt (``p`` = its length, at least
    1). Groups are numbered in order of first appearance."""
    if not (input_ids.shape == attention_mask.shape == action_mask.shape) or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)} and "
                         f"action_mask {tuple(action_mask.shape)} must be equal [B, T]")
    length = attention_mask.ne(0).sum(dim=1).cpu()
    acts = action_mask.ne(0).cpu()
    has_action = acts.any(dim=1)
    first_action = acts.to(torch.int8).argmax(dim=1)
    plen = torch.where(has_action, first_action, length).clamp(min=1)
    ids = input_ids.cpu()
    index: dict[bytes, int] = {}
    group = torch.empty(ids.shape[0], dtype=torch.long)
    first: list[int] = []
    for b in range(ids.shape[0]):
        p = int(plen[b])
        key = p.to_bytes(8, "little") + ids[b, :p].numpy().tobytes()
        u = index.get(key)
        if u is None:
            u = index[key] = len(first)
            first.append(b)
        group[b] = u
    return PromptGroups(group=group, first=torch.tensor(first, dtype=torch.long), prompt_len=plen, length=length)


BUCKET_OVERHEAD_TOKENS = 32
"""What one more response forward costs, in padded tokens: :func:`length_buckets` opens a new bucket only where
it saves more padding than this. Measured on SmolLM2-135M (docs/benchmarks.md): each forward adds a sum of every
parameter's gradient in the backward and smaller, slower weight-gradient GEMMs; 8, 32 and 128 gave about the same
step there, and a single bucket none of the gain."""


def length_buckets(lengths: Sequence[int], overhead: int | None = None) -> list[list[int]]:
    """Partition the indices of ``lengths`` into buckets of rows padded together, minimising
    ``sum_k (|k| * max_{i in k} lengths[i] + overhead)``: the padded tokens of every bucket plus a fixed cost per
    bucket (``None``: :data:`BUCKET_OVERHEAD_TOKENS`, read at the call). Contract: buckets are runs of the indices
    sorted by length, longest first (ties by index), and never split equal lengths (an optimal partition need not:
    the rows of a split run cost their length in either bucket); the exact optimum by dynamic programming over the
    ``D`` distinct lengths, ``O(D^2)``. Every index appears once; ``[]`` for no rows."""
    if overhead is None:
        overhead = BUCKET_OVERHEAD_TOKENS
    if overhead < 0:
        raise ValueError(f"overhead must be >= 0, got {overhead}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    values: list[int] = []
    counts: list[int] = []
    for i in order:
        if values and values[-1] == lengths[i]:
            counts[-1] += 1
        else:
            values.append(lengths[i])
            counts.append(1)
    D = len(values)
    vals = np.asarray(values, dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(counts)])  # prefix[d]: rows of the first d distinct lengths
    best = np.zeros(D + 1, dtype=np.int64)  # best[d]: the least cost of the first d distinct lengths
    cut = [0] * (D + 1)
    for d in range(1, D + 1):  # the last bucket is distinct lengths j .. d-1, padded to values[j]
        cost = best[:d] + (prefix[d] - prefix[:d]) * vals[:d] + overhead
        cut[d] = int(np.argmin(cost))
        best[d] = cost[cut[d]]
    bounds: list[int] = []
    d = D
    while d > 0:
        bounds.append(d)
        d = cut[d]
    starts = [0] + [int(prefix[b]) for b in reversed(bounds)]
    return [order[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def bucketed_tokens(lengths: Sequence[int], overhead: int | None = None) -> int:
    """The padded tokens of :func:`length_buckets`' partition: ``sum_k |k| * max_{i in k} lengths[i]``."""
    return sum(len(k) * max(lengths[i] for i in k) for k in length_buckets(lengths, overhead))


def check_shareable(model: torch.nn.Module) -> bool:
    """True when ``model`` can run the shared-prompt forward: it splits at a plain linear LM head
    (:func:`~posttrain.learner.logprobs.linear_head_of`); else ``ValueError`` naming ``optim.share_prompts``."""
    if linear_head_of(model) is None:
        raise ValueError("share_prompts (optim.share_prompts) needs a model split at a plain linear LM head "
                         f"(model types {sorted(HEAD_IS_LM_HEAD_OF_LAST_HIDDEN)}); this {type(model).__name__} has none")
    return True


def _cache_kw(backbone: torch.nn.Module) -> str:
    """The backbone's cache argument: transformers 5 calls it ``cache``, earlier versions ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(backbone.forward).parameters else "past_key_values"


def _layer_states(cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)`` ``[U, H_kv, P, D]`` of a transformers ``DynamicCache``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers 5: one DynamicLayer per layer
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # type: ignore[attr-defined]


def _expanded_cache(cache: object, index: torch.Tensor) -> object:
    """A new ``DynamicCache`` whose row ``b`` is row ``index[b]`` of ``cache`` (copies, with their graph)."""
    from transformers import DynamicCache

    states = [(k.index_select(0, index), v.index_select(0, index)) for k, v in _layer_states(cache)]
    if "ddp_cache_data" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(states)
    # an older transformers, whose first argument is not the data (it would be taken silently as another one)
    return DynamicCache.from_legacy_cache(tuple(states))  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """One length bucket's response forward: rows ``idx``, response tokens ``1 .. C - 1`` as ``ids`` / ``mask``
    ``[n, C - 1]`` at ``positions`` (continuing from each row's prompt); ``C`` its longest response."""

    idx: torch.Tensor
    C: int
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor


def _buckets(input_ids: torch.Tensor, plen: torch.Tensor, resp_len: torch.Tensor) -> list[_Bucket]:
    """The length buckets (:func:`length_buckets`) of the rows with a response, each padded to its own longest."""
    out = []
    for rows in length_buckets(resp_len.tolist()):
        idx = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
        n_resp = resp_len[idx]
        C = int(n_resp.max())
        if C == 0:
            continue
        rc = torch.arange(C - 1, device=idx.device)[None]
        mask = (rc < n_resp[:, None]).long()
        ids = input_ids[idx].gather(1, (plen[idx][:, None] + rc).clamp(max=input_ids.shape[1] - 1)) * mask
        out.append(_Bucket(idx=idx, C=C, ids=ids, mask=mask, positions=plen[idx][:, None] + rc))
    return out


def _bucket_hidden(head: LinearHead, kw: str, cache: object, bucket: _Bucket, embeds: torch.Tensor,
                   p_mask: torch.Tensor, group: torch.Tensor, resp_len: torch.Tensor, h_first: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden states predicting every response token of one length bucket: ``(hidden [N, D], r, j)`` for its
    ``N`` real tokens, token ``j`` of row ``bucket.idx[r]``. Token 0 is predicted by the prompt's last position
    (``h_first``); tokens ``1 .. C - 1`` by the response forward (``embeds``, the bucket's ids embedded) against
    the rows' copies of their prompt's cache."""
    idx = bucket.idx
    hidden = h_first[idx][:, None]
    if bucket.C > 1:
        g = group[idx]
        mask = torch.cat([p_mask.index_select(0, g), bucket.mask], 1)
        out_r = head.backbone(inputs_embeds=embeds, attention_mask=mask, position_ids=bucket.positions,
                              use_cache=True, **{kw: _expanded_cache(cache, g)})
        hidden = torch.cat([hidden, out_r.last_hidden_state], dim=1)  # [n, C, D]
    r, j = (torch.arange(bucket.C, device=idx.device)[None] < resp_len[idx][:, None]).nonzero(as_tuple=True)
    return hidden[r, j], r, j


def shared_prompt_logprobs(
    head: LinearHead, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor, *,
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, with_entropy: bool = False,
    entropy_grad: bool = True, chunk_cap: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logprob[b, t] = log softmax(z[b, t-1] / T)[input_ids[b, t]]`` (over the sampler's kept set with
    ``top_k`` / ``top_p``) and the entropy, as :func:`~posttrain.learner.logprobs.forward_logprobs` computes them,
    for every real column from each row's first action column on (:func:`prompt_groups`); 0 before it and on
    padding. The prompt is forwarded once per distinct prompt (module docstring); the head runs chunked on the
    gathered hidden states (:func:`~posttrain.learner.chunked_head.chunked_token_logprobs`)."""
    B, T = input_ids.shape
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dev = input_ids.device
    pg = prompt_groups(input_ids, attention_mask, action_mask)
    group, plen, length = pg.group.to(dev), pg.prompt_len.to(dev), pg.length.to(dev)
    P = int(pg.prompt_len.max())
    cols = torch.arange(P, device=dev)[None]
    first = pg.first.to(dev)
    p_mask = (cols < plen[first][:, None]).long()  # [U, P]
    p_ids = input_ids[first, :P] * p_mask
    kw = _cache_kw(head.backbone)
    resp_len = (length - plen).clamp(min=0)
    buckets = _buckets(input_ids, plen, resp_len)
    # every token of the micro-batch embedded in one call: one (dense) embedding gradient in the backward, not one
    # per forward
    flat = [p_ids.reshape(-1)] + [bk.ids.reshape(-1) for bk in buckets]
    embed: torch.nn.Module = head.backbone.get_input_embeddings()  # type: ignore[operator]
    parts = embed(torch.cat(flat)).split([f.numel() for f in flat])
    out = head.backbone(inputs_embeds=parts[0].view(*p_ids.shape, parts[0].shape[-1]), attention_mask=p_mask,
                        use_cache=True)
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError("share_prompts: the model returned no KV cache from its prompt forward (gradient "
                           "checkpointing in train mode turns the cache off)")
    # the hidden state predicting response token j: the prompt's last position (j = 0), else response j - 1
    h_first = out.last_hidden_state[group, plen - 1]  # [B, D]
    hiddens, rows_all, j_all = [h_first[:0]], [group[:0]], [group[:0]]
    for bk, emb in zip(buckets, parts[1:], strict=True):
        embeds = emb.view(*bk.ids.shape, emb.shape[-1])
        hidden, r, j = _bucket_hidden(head, kw, cache, bk, embeds, p_mask, group, resp_len, h_first)
        hiddens.append(hidden)
        rows_all.append(bk.idx[r])
        j_all.append(j)
    rows, j = torch.cat(rows_all), torch.cat(j_all)
    cols_t = plen[rows] + j
    lp, ent = chunked_token_logprobs(
        torch.cat(hiddens), head.weight, input_ids[rows, cols_t], temperature=temperature, top_k=top_k, top_p=top_p,
        with_entropy=with_entropy, entropy_grad=entropy_grad,
        chunk_tokens=chunk_tokens_for(head.weight.shape[0], chunk_cap))
    logprob = lp.new_zeros(B, T).index_put((rows, cols_t), lp)
    entropy = ent.new_zeros(B, T).index_put((rows, cols_t), ent) if ent is not None else None
    return logprob, entropy


def shared_prompt_microbatches(tensors: RowTensors, rows: Sequence[int], budget: int | None) -> list[Microbatch]:
    """The micro-batches of mini-batch ``rows`` for the shared-prompt forward: whole prompt groups
    (:func:`prompt_groups`, in order of first appearance) packed greedily while a micro-batch's shared cost
    ``U * P_max + bucketed_tokens(C_b)`` (prompt tokens once per distinct prompt, response tokens per row padded
    within the forward's own length buckets, :func:`length_buckets`) stays within ``budget`` (``None``: one
    micro-batch). A group that alone exceeds it is cut into runs of its rows (longest first) with
    ``P + n * C_max`` within it, at least one row each. Every row appears once; each micro-batch is trimmed to its
    longest row (:func:`~posttrain.learner.microbatch.take_rows`). Padded micro-batches sort rows by length
    instead (:func:`~posttrain.learner.microbatch.microbatches`), which scatters a group's rows over several
    passes."""
    if not rows:
        return []
    ids, am, act = tensors["input_ids"], tensors["attention_mask"], tensors["action_mask"]
    if ids is None or am is None or act is None:
        raise ValueError("the shared-prompt micro-batches need input_ids, attention_mask and action_mask")
    index = torch.as_tensor(list(rows), dtype=torch.long, device=ids.device)
    pg = prompt_groups(ids.index_select(0, index), am.index_select(0, index), act.index_select(0, index))
    plen, resp = pg.prompt_len.tolist(), (pg.length - pg.prompt_len).clamp(min=0).tolist()
    members: list[list[int]] = [[] for _ in range(pg.num_prompts)]
    for i, u in enumerate(pg.group.tolist()):
        members[u].append(i)
    parts: list[list[int]] = []
    cur: list[int] = []
    n_prompts = p_max = 0
    for m in members:
        m = sorted(m, key=lambda i: (-resp[i], i))
        p_g, c_g = plen[m[0]], resp[m[0]]
        alone_too_large = budget is not None and p_g + bucketed_tokens([resp[i] for i in m]) > budget
        if cur and budget is not None and (alone_too_large or (n_prompts + 1) * max(p_max, p_g)
                                           + bucketed_tokens([resp[i] for i in cur + m]) > budget):
            parts.append(cur)
            cur, n_prompts, p_max = [], 0, 0
        if alone_too_large:
            assert budget is not None
            step = max(1, (budget - p_g) // max(c_g, 1))
            parts += [m[k:k + step] for k in range(0, len(m), step)]
            continue
        cur += m
        n_prompts, p_max = n_prompts + 1, max(p_max, p_g)
    if cur:
        parts.append(cur)
    lengths = pg.length.tolist()
    out = []
    for part in parts:
        idx = [rows[i] for i in sorted(part)]
        out.append(Microbatch(idx, take_rows(tensors, idx, max(1, max(lengths[i] for i in part)))))
    return out
