"""LoRA adapters through ``peft`` (optional extra ``posttrain[peft]``).

LoRA (Hu et al. 2021, arXiv:2106.09685): a frozen weight ``W`` plus a trainable low-rank
update, ``W x + (alpha / r) B A x``. The rollout engine and ``from_pretrained`` consumers
need plain weights, so :func:`merged_state_dict` returns ``W + (alpha / r) B A`` under the
base model's own parameter names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

# Module types peft puts adapters on (transformers' GPT-2 style Conv1D by class name: no import here).
_ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)
_SHOWN_NAMES = 12  # module names an error lists before "..."


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:  # the optional extra is missing: say how to get it
        raise ImportError("LoRA needs the optional extra: pip install 'posttrain[peft]'") from e
    return peft


def is_peft_model(model: torch.nn.Module) -> bool:
    """True when ``model`` is a ``peft.PeftModel`` (without importing peft if it is absent)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft") for c in type(model).__mro__)


def wrap_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float | None = None,
    target_modules: Sequence[str] | str | None = None,
    dropout: float = 0.0,
) -> torch.nn.Module:
    """Wrap a causal LM with LoRA adapters of rank ``rank`` (``alpha`` defaults to ``2 * rank``).

    ``target_modules=None`` lets peft choose its default for the architecture (attention
    projections for Qwen2/Llama); ``"all-linear"`` adapts every linear layer but the head.
    Only the adapter weights are trainable afterwards. ``dropout`` defaults to 0 so that
    pi_theta equals pi_old exactly before the first step.
    """
    if rank < 1:
        raise ValueError(f"lora rank must be >= 1, got {rank}")
    check_target_modules(model, target_modules)
    peft = _peft()
    cfg = peft.LoraConfig(
        r=rank,
        lora_alpha=float(2 * rank if alpha is None else alpha),
        target_modules=list(target_modules) if isinstance(target_modules, (list, tuple)) else target_modules,
        lora_dropout=dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped: torch.nn.Module = peft.get_peft_model(model, cfg)
    return wrapped


def check_target_modules(model: torch.nn.Module, target_modules: Sequence[str] | str | None) -> None:
    """Raise ``ValueError`` naming ``lora.target_modules``, the entry and the model's adaptable module names
    when an entry matches no module of ``model``; return None otherwise (``None`` and ``"all-linear"`` are
    peft's choice).

    Matching is peft's (``peft.tuners.tuners_utils.check_target_module_exists``): a list entry ``t``
    matches a module whose full dotted name is ``t`` or ends with ``.t``; a string is a regular
    expression that must match a full name. peft itself refuses only a list of which *no* entry
    matches, in its own wording, and adapts the rest of a list silently: a misspelt entry trained
    fewer adapters than asked.
    """
    if target_modules is None or target_modules == "all-linear":
        return
    names = [n for n, _ in model.named_modules() if n]
    if isinstance(target_modules, str):
        try:
            missing = [] if any(re.fullmatch(target_modules, n) for n in names) else [target_modules]
        except re.error as e:
            raise ValueError(f"lora.target_modules={target_modules!r} is not a regular expression ({e})") from None
    else:
        missing = [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not missing:
        return
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if n and (isinstance(m, _ADAPTABLE) or type(m).__name__ == "Conv1D")})
    shown = ", ".join(leaves[:_SHOWN_NAMES]) + (", ..." if len(leaves) > _SHOWN_NAMES else "")
    raise ValueError(f"lora.target_modules={target_modules!r}: {', '.join(map(repr, missing))} matches no module "
                     f"of {type(model).__name__} (a list entry names a module or the end of its dotted name, a "
                     f"string is a regular expression over full names); adaptable modules: {shown}, or 'all-linear'")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Plain-model weights ``W + (alpha / r) B A`` of a peft model, under base-model names.

    Computed out of place (``W`` is never modified: a merge/unmerge round trip in float32 would
    drift ``W`` by rounding every call). Adapted weights are new tensors; the others are the
    live base tensors (no copy), as for a plain model's ``state_dict``.
    """
    base = model.get_base_model()  # type: ignore[operator]
    out = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if "lora_" not in k}
    for name, module in base.named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")):
            continue
        w = module.base_layer.weight.detach()
        delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
        out[f"{name}.weight"] = w + delta
    return out
