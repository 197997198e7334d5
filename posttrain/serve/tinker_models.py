"""Training models of the Tinker API: LoRA adapters (peft; Hu et al. 2021, arXiv:2106.09685) on one
shared base model, each with its own AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101).

Every model is a named peft adapter of one ``PeftModel``; an operation activates its adapter first.
Gradients accumulate over ``forward_backward`` calls until ``optim_step`` (the Tinker contract).
Adapters of a snapshot (sampler weights, a checkpoint) are plain tensors; :meth:`ModelHub.merged`
turns one into full model weights ``W + (alpha/r) B A`` through a scratch adapter of the same shape,
so live training adapters are never touched by sampling.

The hub is a wire adapter over the RL learner's parts: :meth:`ModelHub.forward_backward` checks the data
and runs :func:`posttrain.learner.primitives.forward_backward` with the Tinker loss
(:class:`posttrain.learner.tinker_loss.TinkerLoss`, one batch row per datum); :meth:`ModelHub.optim_step`
is the learner's :class:`~posttrain.learner.optim_step.OptimizerStepper` with the SDK's Adam parameters of
the call.

Memory of a long datum (docs/tinker.md, "Long data are bounded"): the per-token log-probs come from the
learner's chunked LM head (:func:`posttrain.learner.primitives.plain_logprobs` through
:func:`posttrain.learner.chunked_head.chunked_token_logprobs`: at most ``chunk x V`` logits at a time,
never ``[tokens x V]``), with the LoRA-adapted head folded into one weight ``W + (alpha/r) B A``; the
micro-batches hold at most ``checkpoint_above_tokens + 1`` padded tokens, so a longer datum runs alone,
with transformers' activation checkpointing (Chen et al. 2016, arXiv:1604.06174: each layer's activations
are recomputed in the backward instead of kept), as the RL learner's ``optim.gradient_checkpointing`` does.
Both give the values of the plain forward up to the rounding of the chunked GEMMs
(``tests/serve/test_tinker_models.py``). A model whose head is not a plain linear layer over the last
hidden state (:data:`posttrain.learner.logprobs.HEAD_IS_LM_HEAD_OF_LAST_HIDDEN`) takes the plain path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping

import torch

from posttrain.algos.tinker_losses import datum_loss, resolve_loss
from posttrain.errors import UserError
from posttrain.learner.grad_sync import LocalSync
from posttrain.learner.lora import merged_state_dict
from posttrain.learner.optim_step import OptimizerStepper
from posttrain.learner.primitives import ForwardContext, forward_backward, train_mode_if
from posttrain.learner.tinker_loss import TinkerLoss, tinker_batch
from posttrain.serve.wire import DatumIn

CHECKPOINT_ABOVE_TOKENS = 512
"""A datum of more tokens runs with activation checkpointing (see the module doc; measured in docs/tinker.md)."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The SDK's ``LoraConfig``: rank, init seed, and which layers carry adapters."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclasses.dataclass(frozen=True)
class AdamStep:
    """The SDK's ``AdamParams`` of one ``optim_step`` (``grad_clip_norm`` 0 = no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclasses.dataclass
class TrainedModel:
    """One training model: its adapter name, LoRA spec, optimizer (its learning rate set by each
    ``optim_step``: ``schedule`` keeps it) and the optimizer steps taken."""

    model_id: str
    adapter: str
    lora: LoraSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    schedule: torch.optim.lr_scheduler.LRScheduler
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """Per datum the target log-probs ``[N]``; the summed loss (``loss:sum``)."""

    logprobs: list[torch.Tensor]
    loss_sum: float


def layer_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """Leaf names of the base model's linear layers by group: ``attn`` (under ``*attn*``), ``mlp``
    (under ``*mlp*``) and ``unembed`` (the output embedding). Read before any adapter is added."""
    out_emb = model.get_output_embeddings()  # type: ignore[operator]
    groups: dict[str, set[str]] = {"attn": set(), "mlp": set(), "unembed": set()}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if mod is out_emb:
            groups["unembed"].add(leaf)
        elif "attn" in name:
            groups["attn"].add(leaf)
        elif "mlp" in name:
            groups["mlp"].add(leaf)
    return {k: sorted(v) for k, v in groups.items()}


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether train mode changes ``model``'s outputs: a ``Dropout`` module with ``p > 0`` or a config
    ``*dropout*`` rate > 0 (transformers' attention applies ``attention_dropout`` in train mode only)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    cfg = getattr(model, "config", None)
    rates = cfg.to_dict() if cfg is not None and hasattr(cfg, "to_dict") else {}
    return any("dropout" in k and isinstance(v, (int, float)) and v > 0 for k, v in rates.items())


def target_modules(groups: Mapping[str, list[str]], spec: LoraSpec) -> list[str]:
    """The leaf names ``spec`` adapts (``train_attn`` / ``train_mlp`` / ``train_unembed``)."""
    names = [n for g, on in (("attn", spec.train_attn), ("mlp", spec.train_mlp), ("unembed", spec.train_unembed))
             if on for n in groups[g]]
    if not names:
        raise UserError(f"LoRA config {spec}: no layer of the base model to adapt")
    return names


class ModelHub:
    """The base model, its adapters (training models and snapshot scratch adapters) and optimizers."""

    def __init__(self, base_model: str, model: torch.nn.Module, *,
                 checkpoint_above_tokens: int = CHECKPOINT_ABOVE_TOKENS, head_chunk_tokens: int | None = None) -> None:
        """``checkpoint_above_tokens``: a ``forward_backward`` datum of more tokens runs with activation
        checkpointing (when the model supports it and has no dropout); ``head_chunk_tokens``: tokens per
        chunk of the LM head (``None``: :func:`~posttrain.learner.chunked_head.chunk_tokens_for` of ``V``)."""
        if checkpoint_above_tokens < 0:
            raise ValueError(f"checkpoint_above_tokens must be >= 0, got {checkpoint_above_tokens}")
        self.base_model = base_model
        self._plain = model
        self._peft: torch.nn.Module | None = None
        self.models: dict[str, TrainedModel] = {}
        self._scratch: dict[LoraSpec, str] = {}
        self._groups = layer_groups(model)
        self.checkpoint_above_tokens = checkpoint_above_tokens
        self.head_chunk_tokens = head_chunk_tokens
        self.checkpointing = bool(getattr(model, "supports_gradient_checkpointing", False)) and not has_dropout(model)
        if self.checkpointing:  # acts only in train mode, which forward_backward turns on for a long datum
            # transformers >= 5 names it activation_checkpointing_enable (the old name warns)
            enable: Callable[[], object] | None = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()  # type: ignore[operator]
        model.eval()

    @property
    def module(self) -> torch.nn.Module:
        """The live network (the peft wrapper once any adapter exists)."""
        return self._peft if self._peft is not None else self._plain

    def _add_adapter(self, name: str, spec: LoraSpec) -> None:
        import peft

        cfg = peft.LoraConfig(r=spec.rank, lora_alpha=2 * spec.rank, lora_dropout=0.0, bias="none",
                              target_modules=target_modules(self._groups, spec), task_type="CAUSAL_LM")
        # peft warns about an adapter on a tied unembedding because merging in place would change the input
        # embedding too; nothing here merges in place (merged_state_dict is out of place, the sampler is untied).
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            # peft reads transformers' deprecated is_gradient_checkpointing property (a FutureWarning on every adapter)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self._peft is None:
                self._peft = peft.get_peft_model(self._plain, cfg, adapter_name=name)
            else:
                self._peft.add_adapter(name, cfg)  # type: ignore[operator]

    def _activate(self, adapter: str) -> torch.nn.Module:
        assert self._peft is not None
        self._peft.set_adapter(adapter)  # type: ignore[operator]
        return self._peft

    def create(self, model_id: str, spec: LoraSpec) -> TrainedModel:
        """A new training model (adapter ``B = 0``: it starts as the base model)."""
        if spec.rank < 1:
            raise UserError(f"create_model: LoRA rank must be >= 1, got {spec.rank}")
        adapter = f"m{len(self.models)}"
        self._add_adapter(adapter, spec)
        assert self._peft is not None
        params = [p for n, p in self._peft.named_parameters() if f".{adapter}." in n]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=1e-4)
        keep_lr = torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda _: 1.0)  # each call sets the lr
        tm = TrainedModel(model_id, adapter, spec, params, opt, keep_lr)
        self.models[model_id] = tm
        return tm

    def get(self, model_id: str) -> TrainedModel:
        """The training model ``model_id``; ``UserError`` if there is none."""
        tm = self.models.get(model_id)
        if tm is None:
            raise UserError(f"unknown model_id {model_id!r}")
        return tm

    def forward_backward(self, model_id: str, data: list[DatumIn], loss_fn: str,
                         config: Mapping[str, float | str], *, forward_only: bool) -> ForwardResult:
        """Target log-probs of every datum and the summed loss; unless ``forward_only``, its gradient is
        added to the model's accumulated gradients. Datum ``i``'s log-prob at position ``t`` is
        ``log p(target_tokens[t] | tokens[:t+1])``.

        Every datum is checked before anything runs (``UserError`` naming the datum: token counts and ids,
        its ``loss_fn_inputs``); then one :func:`~posttrain.learner.primitives.forward_backward` of the
        data's :func:`~posttrain.learner.tinker_loss.tinker_batch` with :class:`TinkerLoss` on the active
        adapter, in micro-batches of at most ``checkpoint_above_tokens + 1`` padded tokens; the data longer
        than ``checkpoint_above_tokens`` run in a second call, each alone, in train mode (activation
        checkpointing; the model has no dropout when it is on)."""
        tm = self.get(model_id)
        spec, cfg = resolve_loss(loss_fn, config)
        net = self._activate(tm.adapter)
        vocab = int(net.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
        inputs = []
        for i, d in enumerate(data):
            targets = d.inputs["target_tokens"]
            if len(d.tokens) != targets.shape[0]:
                raise UserError(f"datum {i}: {len(d.tokens)} input tokens but {targets.shape[0]} target_tokens")
            if not d.tokens or max(d.tokens + targets.tolist()) >= vocab or min(d.tokens + targets.tolist()) < 0:
                raise UserError(f"datum {i}: token ids must be in [0, {vocab}) and the input non-empty")
            inputs.append({k: v for k, v in d.inputs.items() if k != "target_tokens"})
            # its inputs' names and shapes (the loss of zero log-probs: nothing runs before every datum passes)
            datum_loss(spec, loss_fn, torch.zeros(len(d.tokens)), {k: v.float() for k, v in inputs[-1].items()}, cfg, i)
        if not data:
            return ForwardResult([], 0.0)
        loss = TinkerLoss(loss_fn, spec, cfg, forward_only=forward_only)
        device = next(iter(tm.params)).device
        batch = tinker_batch([d.tokens for d in data], [d.inputs["target_tokens"] for d in data], inputs, loss.keys,
                             device)
        long = [i for i, d in enumerate(data) if len(d.tokens) > self.checkpoint_above_tokens]
        short = [i for i in batch.rows if i not in set(long)]
        checkpoint = self.checkpointing and not forward_only
        parts = [(short, False), (long, checkpoint)] if checkpoint else [(list(batch.rows), False)]
        lp: torch.Tensor | None = None
        total = 0.0
        for rows, train in parts:
            if not rows:
                continue
            ctx = ForwardContext(
                model=net, temperature=1.0, top_k=0, top_p=1.0, microbatch_tokens=self.checkpoint_above_tokens + 1,
                entropy_chunk_size=self.head_chunk_tokens, compute_dtype=torch.float32,
                autocast=contextlib.nullcontext, grad_mode=functools.partial(train_mode_if, net, train),
                grad_sync=LocalSync(), params=tm.params)
            out = forward_backward(ctx, dataclasses.replace(batch, rows=rows), loss)
            assert out.logprob is not None
            lp = out.logprob if lp is None else torch.where(out.logprob.isnan(), lp, out.logprob)
            total += out.loss
        assert lp is not None
        return ForwardResult([lp[i, 1:len(d.tokens) + 1].float() for i, d in enumerate(data)], total)

    def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        """One AdamW step on the accumulated gradients, then zero them: the learner's
        :class:`~posttrain.learner.optim_step.OptimizerStepper` (clipped to ``grad_clip_norm`` when > 0) with
        the call's Adam parameters. Tinker steps on a zero gradient too (AdamW's moments and weight decay
        still move the weights), so a step the stepper skips as ``zero_grad`` is taken here; a non-finite
        norm takes none (the gradient is dropped). Returns ``{"grad_norm:mean": ...}`` (the norm before
        clipping; NaN when not finite)."""
        tm = self.get(model_id)
        for g in tm.optimizer.param_groups:
            g.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                     weight_decay=step.weight_decay)
        clip = step.grad_clip_norm if step.grad_clip_norm > 0 else None
        outcome = OptimizerStepper(tm.params, tm.optimizer, tm.schedule, clip).apply()
        if outcome.skipped == "zero_grad":
            tm.optimizer.step()
        tm.optimizer.zero_grad(set_to_none=True)
        tm.steps += 1
        return {"grad_norm:mean": outcome.grad_norm if outcome.grad_norm is not None else math.nan}

    def adapter_state(self, model_id: str) -> dict[str, torch.Tensor]:
        """A copy of the model's adapter tensors (peft names without the adapter name)."""
        import peft

        tm = self.get(model_id)
        state = peft.get_peft_model_state_dict(self.module, adapter_name=tm.adapter, save_embedding_layers=False)
        return {k: v.detach().clone() for k, v in state.items()}

    def load_adapter_state(self, model_id: str, state: Mapping[str, torch.Tensor]) -> None:
        """Copy saved adapter tensors into the model's adapter in place (optimizer references stay valid)."""
        tm = self.get(model_id)
        self._load_into(tm.adapter, state)

    def _load_into(self, adapter: str, state: Mapping[str, torch.Tensor]) -> None:
        import peft

        with torch.no_grad():
            res = peft.set_peft_model_state_dict(self.module, dict(state), adapter_name=adapter)
        bad = [k for k in getattr(res, "unexpected_keys", []) if "lora_" in k]
        if bad:
            raise UserError(f"checkpoint adapter does not fit this model: unexpected {bad[:3]}")

    def merged(self, snapshot: tuple[LoraSpec, Mapping[str, torch.Tensor]] | None) -> dict[str, torch.Tensor]:
        """Full plain-model weights: the base (``None``) or base + a snapshot's adapter, under base names."""
        if self._peft is None:
            return dict(self._plain.state_dict())
        if snapshot is None:
            base = self._peft.get_base_model()  # type: ignore[operator]
            return {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if "lora_" not in k}
        spec, state = snapshot
        scratch = self._scratch.get(spec)
        if scratch is None:
            scratch = self._scratch[spec] = f"s{len(self._scratch)}"
            self._add_adapter(scratch, spec)
        self._load_into(scratch, state)
        return merged_state_dict(self._activate(scratch))
