"""The Qwen2 / Llama decoder layout that the static-cache runner calls into, as Protocols.

A transformers model reaches its sub-modules through ``torch.nn.Module.__getattr__`` (typed
``Tensor | Module``), so nothing about ``model.model.layers[0].self_attn`` is known to a type
checker. These Protocols name the attributes :class:`~posttrain.rollout.runners.StaticCacheRunner`
reads, no more. :func:`~posttrain.rollout.runners.supports_fast_path` is the runtime check that a
model is of a family with this layout (each family is tested against ``generate``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

TensorMap = Callable[[torch.Tensor], torch.Tensor]
"""A sub-module used as a function of one tensor (projection, norm, MLP, head)."""


class DecoderAttention(Protocol):
    """A layer's ``self_attn``: the q/k/v/o projections, the head size and the softmax scale."""

    head_dim: int
    scaling: float
    q_proj: TensorMap
    k_proj: TensorMap
    v_proj: TensorMap
    o_proj: TensorMap


class DecoderLayer(Protocol):
    """``input_layernorm -> self_attn -> residual -> post_attention_layernorm -> mlp -> residual``."""

    self_attn: DecoderAttention
    input_layernorm: TensorMap
    post_attention_layernorm: TensorMap
    mlp: TensorMap


class DecoderLayers(Protocol):
    """The ``nn.ModuleList`` of layers: indexed and iterated."""

    def __getitem__(self, index: int, /) -> DecoderLayer: ...

    def __iter__(self) -> Iterator[DecoderLayer]: ...


class TokenEmbedding(Protocol):
    """``embed_tokens``: ids ``[B, S]`` -> hidden ``[B, S, H]``; its ``weight`` gives dtype and device."""

    weight: torch.Tensor

    def __call__(self, ids: torch.Tensor, /) -> torch.Tensor: ...


class DecoderCore(Protocol):
    """``model.model``: embeddings, layers, final norm and the rotary embedding ``(x, pos) -> (cos, sin)``."""

    embed_tokens: TokenEmbedding
    layers: DecoderLayers
    norm: TensorMap
    rotary_emb: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DecoderConfig(Protocol):
    """The config field the runner reads besides the modules' own sizes."""

    num_key_value_heads: int


class FastPathDecoder(Protocol):
    """A Qwen2 / Llama ``*ForCausalLM``: config, decoder core and the LM head."""

    config: DecoderConfig
    model: DecoderCore
    lm_head: TensorMap
