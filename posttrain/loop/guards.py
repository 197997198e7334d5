"""Run monitors: thresholds on step metrics that warn or stop the run with a reason.

Each guard reads documented metric keys; a breach is logged (and, with ``action: stop``,
returned as the stop reason, which the loop records in the metrics log and the ledger).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("posttrain")


def breaches(g: Any, m: Mapping[str, Any]) -> list[str]:
    """Human-readable breaches of the guard thresholds ``g`` (a GuardsConfig) in metrics ``m``."""
    out: list[str] = []
    for k, v in m.items():
        if isinstance(v, float) and not math.isfinite(v) and not k.startswith(("heldout", "logkappa", "kl/")):
            if k in ("loss", "pg_loss", "grad_norm", "reward/mean"):
                out.append(f"{k} is {v} (NaN/inf)")
    lk = m.get("logkappa_abs_max")
    if isinstance(lk, float) and lk > g.max_abs_log_kappa:
        out.append(f"train/rollout mismatch: max |log kappa| {lk:.3g} > {g.max_abs_log_kappa:g}")
    ent = m.get("entropy")
    if isinstance(ent, float) and ent < g.min_entropy:
        out.append(f"entropy collapse: {ent:.3g} < {g.min_entropy:g}")
    tr = m.get("finish/truncated_rate")
    if isinstance(tr, float) and tr > g.max_truncation_rate:
        out.append(f"truncation rate {tr:.2f} > {g.max_truncation_rate:g} (length blow-up)")
    z = m.get("adv/zero_group_frac")
    if isinstance(z, float) and z > g.max_zero_adv_fraction:
        out.append(f"zero-advantage group fraction {z:.2f} > {g.max_zero_adv_fraction:g}")
    ln = m.get("length/mean")
    if isinstance(ln, float) and ln < g.min_response_length:
        out.append(f"response-length collapse: mean {ln:.2f} < {g.min_response_length:g}")
    return out


def check_guards(g: Any, m: dict[str, Any]) -> str | None:
    """Log breaches into ``m['guards']``; return a stop reason when ``g.action == 'stop'``."""
    found = breaches(g, m)
    if not found:
        return None
    m["guards"] = "; ".join(found)
    for b in found:
        log.warning("guard: %s", b)
    return m["guards"] if g.action == "stop" else None
