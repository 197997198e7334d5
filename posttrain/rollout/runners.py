"""Model runners of the built-in engine: batched prefill and KV-cache decode.

A runner turns token ids into next-token logits. Rows are left-padded to a common prompt
length ``T``; ``mask [B, T]`` is 1 on real tokens; the position id of a token is the number of
real tokens before it (``cumsum(mask) - 1``), so left padding changes nothing a row sees.

- :class:`HFRunner` works for any ``transformers`` causal LM: it calls the model's own forward
  with a ``DynamicCache`` (Hugging Face's growing KV cache).
- :class:`StaticCacheRunner` is the fast path for Qwen2- and Llama-style decoders (SmolLM2 is a
  Llama; no sliding window): it calls the decoder's own sub-modules (norms, projections, MLP, rotary embedding) but keeps a static,
  preallocated KV cache written in place and runs attention through
  ``scaled_dot_product_attention``, avoiding Hugging Face's per-step mask and cache bookkeeping.
  Same arithmetic as the model, so greedy tokens match ``generate`` (tested).

Both keep per-row state that :meth:`select` re-indexes: repeated indices share a prefilled
prompt across ``n`` samples, a subset drops finished rows so they cost no compute. ``prefill``
returns that state inside a :class:`DecodeSession`, which threads it through ``select`` and
``decode``, so the engine drives either runner without knowing its state type.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Generic, Protocol, TypeGuard, TypeVar

import torch
import torch.nn.functional as F

from posttrain.rollout.decoder_layout import FastPathDecoder

if TYPE_CHECKING:  # transformers is imported when a runner is built, not with this module
    from transformers import DynamicCache, PreTrainedModel

StateT = TypeVar("StateT")


class StateOps(Protocol[StateT]):
    """A runner's per-row state operations (see the module docstring)."""

    def select(self, state: StateT, index: torch.Tensor) -> StateT:
        """Rows ``index`` of ``state``."""
        ...

    def decode(self, state: StateT, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens [B]`` to ``state`` (in place) and return the next logits ``[B, V]``."""
        ...


@dataclasses.dataclass
class DecodeSession(Generic[StateT]):
    """A prefilled batch: its runner and the runner's current per-row state."""

    runner: StateOps[StateT]
    state: StateT

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (repeats expand, subsets compact)."""
        self.state = self.runner.select(self.state, index)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens [B]`` and return the next logits ``[B, V]``."""
        return self.runner.decode(self.state, tokens)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """``pos[b, t] = (number of real tokens in row b before t)``, 0 on (left) padding."""
    return (mask.long().cumsum(-1) - 1).clamp_(min=0)


@dataclasses.dataclass
class HFState:
    """Generic runner state: Hugging Face cache plus the growing ``[B, T_total]`` attention mask."""

    cache: DynamicCache
    mask: torch.Tensor


class HFRunner:
    """Any HF causal LM: ``model(input_ids, attention_mask, position_ids, cache)`` per step."""

    def __init__(self, model: PreTrainedModel) -> None:
        from transformers import DynamicCache

        self.model = model
        self._cache_cls = DynamicCache
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values -> cache; accept either spelling.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self._cache_kw: cache}
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, DecodeSession[HFState]]:
        """Logits ``[U, V]`` at the last prompt position and a session over the cache of the ``U`` prompts."""
        try:
            cache = self._cache_cls(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            cache = self._cache_cls()
        mask = mask.long()
        logits = self._forward(ids, mask, position_ids_from_mask(mask), cache)
        return logits, DecodeSession(self, HFState(cache, mask))

    def select(self, state: HFState, index: torch.Tensor) -> HFState:
        """Rows ``index`` of the state (repeats expand, subsets compact)."""
        state.cache.batch_select_indices(index)
        return HFState(state.cache, state.mask.index_select(0, index))

    def decode(self, state: HFState, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens [B]`` and return the next logits ``[B, V]``."""
        mask = torch.cat([state.mask, state.mask.new_ones(state.mask.shape[0], 1)], dim=1)
        pos = (mask.sum(-1, keepdim=True) - 1).clamp_(min=0)
        logits = self._forward(tokens[:, None], mask, pos, state.cache)
        state.mask = mask
        return logits


@dataclasses.dataclass
class StaticState:
    """Fast runner state: ``keys/values[l] [B, Hkv, cap, D]``, ``valid [B, cap]``, used length, next positions."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    length: int
    next_pos: torch.Tensor
    padded: bool = True  # some row has an invalid (padding) column: attention needs the mask


#: Decoder families whose layers are ``input_layernorm -> self_attn(q/k/v/o_proj, rotary) -> residual ->
#: post_attention_layernorm -> mlp -> residual`` with the rotary module on ``model.model.rotary_emb``:
#: the layout :class:`StaticCacheRunner` calls into (each family tested against ``generate``).
FAST_PATH_MODEL_TYPES: frozenset[str] = frozenset({"qwen2", "llama"})


def supports_fast_path(model: torch.nn.Module) -> TypeGuard[FastPathDecoder]:
    """Decoders of :data:`FAST_PATH_MODEL_TYPES` without sliding-window attention (the families
    with the :class:`~posttrain.rollout.decoder_layout.FastPathDecoder` layout)."""
    cfg = getattr(model, "config", None)
    return (
        cfg is not None
        and getattr(cfg, "model_type", None) in FAST_PATH_MODEL_TYPES
        and not getattr(cfg, "use_sliding_window", False)
        and hasattr(model, "model")
        and hasattr(model.model, "layers")
    )


class StaticCacheRunner:
    """Static-cache decode calling a Qwen2 / Llama decoder's modules directly (see the module docstring)."""

    def __init__(self, model: FastPathDecoder) -> None:
        # The same rotary application in both families (rotate_half on [B, H, S, D] with cos/sin [B, S, D]).
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model = model
        self.core = model.model
        self._rope = apply_rotary_pos_emb
        a0 = self.core.layers[0].self_attn
        self.head_dim = int(a0.head_dim)
        self.scaling = float(a0.scaling)
        cfg = model.config
        self.n_kv = int(cfg.num_key_value_heads)

    def _layers(
        self, x: torch.Tensor, pos: torch.Tensor, state: StaticState, t0: int, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Run every decoder layer on ``x [B, S, H]`` whose tokens go to cache columns ``t0..t0+S``.

        ``attn_mask [B, 1, S, t0+S]`` bool, or ``None`` when no row has padding: then prefill is
        plain causal attention and a decode step (``S == 1``) attends to every cached column.
        Decode folds the ``r = H / Hkv`` query heads that share a key/value head into the query
        axis (``q [B, Hkv, r, D]``), so grouped-query attention runs without repeating the cache;
        head ``h`` uses kv head ``h // r`` exactly as ``repeat_kv`` in transformers.
        """
        cos, sin = self.core.rotary_emb(x, pos)
        B, S, _ = x.shape
        t1 = t0 + S
        for li, layer in enumerate(self.core.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, S, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(B, S, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(B, S, -1, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            state.keys[li][:, :, t0:t1] = k
            state.values[li][:, :, t0:t1] = v
            keys, values = state.keys[li][:, :, :t1], state.values[li][:, :, :t1]
            if S == 1:
                Hq = q.shape[1]
                o = F.scaled_dot_product_attention(
                    q.reshape(B, self.n_kv, Hq // self.n_kv, self.head_dim), keys, values,
                    attn_mask=attn_mask, scale=self.scaling,
                ).reshape(B, Hq, 1, self.head_dim)
            else:
                o = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=attn_mask, is_causal=attn_mask is None, scale=self.scaling,
                    enable_gqa=True,
                )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, S, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.core.norm(x_last))

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, DecodeSession[StaticState]]:
        """Prefill ``U`` left-padded prompts into a cache of ``capacity`` columns; last-position logits
        ``[U, V]`` and a session over that cache."""
        U, T = ids.shape
        mask = mask.bool()
        ref = self.core.embed_tokens.weight
        shape = (U, self.n_kv, capacity, self.head_dim)
        state = StaticState(
            keys=[ref.new_empty(shape) for _ in self.core.layers],
            values=[ref.new_empty(shape) for _ in self.core.layers],
            valid=torch.zeros(U, capacity, dtype=torch.bool, device=ids.device),
            length=T,
            next_pos=mask.long().sum(-1),
            padded=not bool(mask.all()),
        )
        state.valid[:, :T] = mask
        am: torch.Tensor | None = None
        if state.padded:
            causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril_()
            am = causal[None] & mask[:, None, :]
            # A padding query would see no key at all (NaN softmax): let it see itself; its output is never used.
            am |= torch.eye(T, dtype=torch.bool, device=ids.device)[None]
            am = am[:, None]
        x = self._layers(self.core.embed_tokens(ids), position_ids_from_mask(mask), state, 0, am)
        return self._logits(x[:, -1]), DecodeSession(self, state)

    def select(self, state: StaticState, index: torch.Tensor) -> StaticState:
        """Rows ``index`` of the state (copies the used columns only)."""
        used = state.length
        cap = state.keys[0].shape[2]

        def pick(c: torch.Tensor) -> torch.Tensor:
            out = c.new_empty((index.numel(), *c.shape[1:]))
            out[:, :, :used] = c[:, :, :used].index_select(0, index)
            return out

        valid = state.valid.index_select(0, index) if cap else state.valid
        return StaticState(
            keys=[pick(k) for k in state.keys],
            values=[pick(v) for v in state.values],
            valid=valid,
            length=used,
            next_pos=state.next_pos.index_select(0, index),
            padded=state.padded and not bool(valid[:, :used].all()),
        )

    def decode(self, state: StaticState, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens [B]`` at column ``length`` and return the next logits ``[B, V]``."""
        t = state.length
        if t >= state.keys[0].shape[2]:
            raise RuntimeError(f"static KV cache full ({t} columns); capacity was sized too small")
        state.valid[:, t] = True
        am = state.valid[:, None, None, : t + 1] if state.padded else None
        x = self.core.embed_tokens(tokens[:, None])
        x = self._layers(x, state.next_pos[:, None], state, t, am)
        state.length = t + 1
        state.next_pos = state.next_pos + 1
        return self._logits(x[:, -1])
