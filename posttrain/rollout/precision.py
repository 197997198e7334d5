"""The built-in engine's compute precision (``rollout.precision``) and whether this CPU runs it natively.

``auto`` (the default): the engine computes in the model's own dtype (``model.dtype``), as the learner does.
``fp32``: the engine computes what the fp32 learner computes, so the behaviour and learner log-probs of a
token agree to float32 rounding (``|log kappa|`` ~ 1e-6). ``bf16``: the engine holds a bfloat16 copy of the
weights and samples from bfloat16 logits (upcast to float64 for the recorded behaviour log-probs, so a
token's recorded log-prob is that of the distribution it was drawn from); the learner keeps its own
precision. That is the split every GPU framework runs (vLLM / SGLang rollouts in bf16 against an fp32-master
learner), and the behaviour / learner mismatch it creates is what the importance-sampling corrections
(token TIS, Yao et al. 2025 "Your efficient RL framework secretly brings you off-policy RL training"; MIS /
IcePop) exist for.

On a CPU, bf16 is fast only where the instruction set multiplies bf16 natively: AVX512_BF16 (``vdpbf16ps``)
or AMX (``amx_bf16``). Elsewhere torch converts through float32 and bf16 is slower than fp32, so
``rollout.precision=bf16`` is refused on such a CPU (a CUDA device always has it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import torch

Precision = Literal["auto", "fp32", "bf16"]

#: The torch dtype each ``rollout.precision`` computes in.
ENGINE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: CPU flags (``/proc/cpuinfo``) that give native bf16 products, and the name each is reported under.
BF16_CPU_FLAGS: dict[str, str] = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512_BF16"}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The ``flags`` of the first processor in ``cpuinfo`` (empty where the file does not exist: not Linux)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def native_bf16(flags: Iterable[str]) -> str | None:
    """The name of the first native-bf16 feature in ``flags`` (AMX before AVX512_BF16), else None."""
    have = set(flags)
    return next((name for flag, name in BF16_CPU_FLAGS.items() if flag in have), None)


def check_engine_precision(precision: str, device: str = "cpu", flags: Iterable[str] | None = None) -> str:
    """A one-line description of what ``rollout.precision=precision`` computes on ``device``.

    Raises ``ValueError`` (one line, naming the key and this CPU's lack) for ``bf16`` on a CPU without
    native bf16 (:data:`BF16_CPU_FLAGS`; ``flags`` default: this machine's :func:`cpu_flags`)."""
    if precision not in ("auto", *ENGINE_DTYPES):
        raise ValueError(f"rollout.precision must be auto, fp32 or bf16, got {precision!r}")
    if precision == "auto":
        return "model.dtype (the learner's numbers)"
    if precision == "fp32":
        return "fp32"
    if device.startswith("cuda"):
        return "bf16 on CUDA"
    feature = native_bf16(cpu_flags() if flags is None else flags)
    if feature is None:
        raise ValueError("rollout.precision=bf16 needs a CPU with native bf16 products (AVX512_BF16 or AMX-BF16); "
                         "this CPU has neither, so bf16 would run slower than fp32: use rollout.precision=fp32")
    return f"bf16 via {feature}"


def engine_copy(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """``model`` itself for ``auto`` or when it already computes in ``precision``'s dtype, else a copy cast
    to it (the learner's model is never cast)."""
    import copy

    if precision == "auto":
        return model
    dtype = ENGINE_DTYPES[precision]
    if next(model.parameters()).dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype)


__all__ = ["BF16_CPU_FLAGS", "ENGINE_DTYPES", "Precision", "check_engine_precision", "cpu_flags", "engine_copy",
           "native_bf16"]
