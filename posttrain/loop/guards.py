"""Run monitors: thresholds on step metrics that warn or stop the run with a reason.

Each guard reads documented metric keys; a breach is logged (and, with ``action: stop``,
returned as the stop reason, which the loop records in the metrics log and the ledger).

Failed verifications are loud: each training step's ``status/*`` counts and each evaluation's
``<prefix>/status/*`` counts (``heldout``, ``heldout_sampled``, ...) are checked against
``guards.max_infra_error_fraction`` (samples with no verdict: ``infra_error``, and ``env_failure`` for
episodes), one warning line per breach, every time. A run in which no verification at all returned a
verdict ends with :class:`NothingJudgedError` (exit code 2 on the command line), see :class:`VerdictTally`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import ItemsView, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from posttrain.config import GuardsConfig

from posttrain.errors import UserError
from posttrain.trajectory import Status, Trajectory

log = logging.getLogger("posttrain")

# Statuses that carry no verdict about the response: the verifier (or the episode's environment) failed.
UNJUDGED = (Status.INFRA_ERROR.value, Status.ENV_FAILURE.value)
_STATUSES = frozenset(s.value for s in Status)


class NothingJudgedError(UserError, ValueError):
    """Every verification of the run failed: no verdict, so nothing was learned or measured (exit code 2)."""


class MetricsView(Protocol):
    """A step's or an evaluation's metrics, read by key (any mapping of ``str`` to values)."""

    def items(self) -> ItemsView[str, object]: ...

    def get(self, key: str, /) -> object: ...


class GuardedMetrics(MetricsView, Protocol):
    """Metrics that :func:`check_guards` also writes its ``guards`` line into."""

    def __setitem__(self, key: str, value: str, /) -> None: ...


def verification_counts(m: MetricsView) -> dict[str, tuple[int, int]]:
    """``{prefix: (samples, unjudged)}`` from the status counts in metrics ``m``.

    ``prefix`` is ``""`` for a training step's ``status/<name>`` keys and e.g. ``"heldout"`` for an
    evaluation's ``heldout/status/<name>`` keys; ``unjudged`` counts :data:`UNJUDGED` statuses.
    """
    out: dict[str, tuple[int, int]] = {}
    for k, v in m.items():
        head, sep, name = k.rpartition("status/")
        if not sep or name not in _STATUSES or (head and not head.endswith("/")) or not isinstance(v, (int, float)):
            continue
        prefix = head.rstrip("/")
        n, bad = out.get(prefix, (0, 0))
        out[prefix] = (n + int(v), bad + (int(v) if name in UNJUDGED else 0))
    return out


def _verification_breaches(g: GuardsConfig, m: MetricsView) -> list[str]:
    out: list[str] = []
    limit = float(g.max_infra_error_fraction)
    for prefix, (n, bad) in sorted(verification_counts(m).items()):
        if n and bad / n >= limit:
            where = "training step" if not prefix else f"evaluation {prefix}"
            what = "every verification failed" if bad == n else f"failed verifications {bad / n:.2f} >= {limit:g}"
            out.append(f"{where}: {what} ({bad} of {n} samples infra_error/env_failure, no verdict; "
                       "the ledger's explanation column says why)")
    return out


def breaches(g: GuardsConfig, m: MetricsView) -> list[str]:
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
    out.extend(_verification_breaches(g, m))
    return out


def check_guards(g: GuardsConfig, m: GuardedMetrics) -> str | None:
    """Log breaches into ``m['guards']``; return a stop reason when ``g.action == 'stop'``."""
    found = breaches(g, m)
    if not found:
        return None
    line = "; ".join(found)
    m["guards"] = line
    for b in found:
        log.warning("guard: %s", b)
    return line if g.action == "stop" else None


class VerdictTally:
    """Verifications of one run invocation (training steps and evaluations): how many, how many failed.

    :meth:`add` reads the status counts of a step's (or the step-0 evaluation's) metrics;
    :meth:`check` raises :class:`NothingJudgedError` when the run verified something and every
    verification failed (``infra_error`` / ``env_failure``): such a run measured and learned nothing,
    so it must not end as a success. ``first_failure`` keeps one explanation for the message.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.unjudged = 0
        self.first_failure = ""

    def add(self, m: MetricsView, trajs: Iterable[Trajectory] = ()) -> None:
        """Count the verifications in metrics ``m``; ``trajs`` (the step's records) give an example reason."""
        for n, bad in verification_counts(m).values():
            self.samples += n
            self.unjudged += bad
        if not self.first_failure:
            for t in trajs:
                if getattr(getattr(t, "status", None), "value", None) in UNJUDGED:
                    self.first_failure = str((t.meta or {}).get("explanation", ""))[:200]
                    break

    def check(self, where: str) -> None:
        """Raise :class:`NothingJudgedError` (naming ``where``, e.g. the run dir) when nothing was judged."""
        if self.samples and self.unjudged == self.samples:
            why = f"; first failure: {self.first_failure}" if self.first_failure else ""
            raise NothingJudgedError(
                f"nothing could be judged: all {self.samples} verifications of the run (training and held-out) "
                f"failed with no verdict (infra_error/env_failure){why}; see {where}")
