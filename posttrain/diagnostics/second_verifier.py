"""An evaluation-only second verifier: re-check responses the training verifier passed.

Reward hacking shows first where the training verifier and an independent judge disagree: audit
first the trajectories with a high reward that a human or a hidden verifier fails. The ledger stores each response's text and reference in ``meta``
(``response``, ``reference``), so any verifier can re-judge them without a model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from posttrain.dotted import import_dotted

NO_SECOND_VERIFIER = ("this ledger records only the training verifier's verdicts (the run had no "
                      "eval.hidden_verifier), so there is nothing to disagree with; pass --verifier NAME (a "
                      "registered verifier such as exact or math, or module.path:factory) to re-judge the passed "
                      "trajectories with an evaluation-only verifier")


def load_verifier(spec: str, kwargs_json: str | None = None) -> Any:
    """A verifier from a registry name or ``module.path:factory`` (+ JSON keyword arguments).

    Raises ``ValueError`` (one line) for an unknown name, a bad path or bad JSON.
    """
    try:
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--verifier-kwargs is not a JSON object: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--verifier-kwargs must be a JSON object")
    if ":" in spec:
        factory = import_dotted(spec, what="--verifier", shape="package.module:factory")
        return factory(**kwargs)
    from posttrain.rewards.verifier import build_verifier

    return build_verifier(spec, **kwargs)


def verifier_label(v: Any) -> str:
    """``name@version`` of a verifier object."""
    return f"{v.name}@{v.version}"


def disagreements(rows: Sequence[dict[str, Any]], verifier: Any | None) -> dict[str, Any]:
    """Trajectories the training verifier marked ``correct`` that ``verifier`` does not.

    ``rows`` are ledger rows (``status`` and ``meta`` JSON) with a ``step`` key added. Returns
    ``{"verifier", "source", "explanation", "checked", "items"}``. With no ``verifier`` the verdicts
    the run's ``eval.hidden_verifier`` recorded in the ledger are used (``source: "ledger"``); when
    there are none, the list is empty and the explanation says why. A second verifier that raises
    counts as ``infra_error`` (never a failure).
    """
    if verifier is None:
        recorded = recorded_disagreements(rows)
        if recorded is not None:
            return recorded
        return {"verifier": None, "source": None, "explanation": NO_SECOND_VERIFIER, "checked": 0, "items": []}
    items, checked = [], 0
    for r in rows:
        if r["status"] != "correct":
            continue
        meta = json.loads(r["meta"]) if isinstance(r["meta"], str) else dict(r["meta"] or {})
        if "response" not in meta or "reference" not in meta:
            continue
        checked += 1
        try:
            v = verifier.verify(str(meta["response"]), meta["reference"])
            status, why = v.status.value, v.explanation
        except Exception as e:  # noqa: BLE001 - a crashing verifier is an infra error, reported per row
            status, why = "infra_error", f"{type(e).__name__}: {e}"
        if status != "correct":
            items.append({"step": r["step"], "traj_id": r["traj_id"], "group_id": r["group_id"],
                          "reward": r["reward_total"], "response": meta["response"], "reference": meta["reference"],
                          "train_verifier": r.get("verifier"), "second_status": status, "second_explanation": why})
    return {"verifier": verifier_label(verifier), "source": "re-judged",
            "explanation": f"{checked} trajectories passed the training verifier; {len(items)} fail "
                           f"{verifier_label(verifier)}", "checked": checked, "items": items}


def recorded_disagreements(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """:func:`disagreements` from the ``hidden_status`` verdicts in the ledger, or ``None`` if none.

    A row counts as checked when the training verifier passed it and the hidden verifier left a
    verdict; it is listed when that verdict is not ``correct``. ``infra_error`` verdicts (a crash of
    the hidden verifier) are listed as such, never read as a failure of the response.
    """
    judged = [r for r in rows if r.get("hidden_status") is not None]
    if not judged:
        return None
    names = sorted({str(r.get("hidden_verifier")) for r in judged})
    items, checked = [], 0
    for r in judged:
        if r["status"] != "correct":
            continue
        checked += 1
        if r["hidden_status"] == "correct":
            continue
        meta = json.loads(r["meta"]) if isinstance(r["meta"], str) else dict(r["meta"] or {})
        items.append({"step": r["step"], "traj_id": r["traj_id"], "group_id": r["group_id"],
                      "reward": r["reward_total"], "response": meta.get("response"), "reference": meta.get("reference"),
                      "train_verifier": r.get("verifier"), "second_status": r["hidden_status"],
                      "second_explanation": str(meta.get("hidden_explanation", ""))})
    label = ", ".join(names)
    return {"verifier": label, "source": "ledger",
            "explanation": f"{checked} trajectories passed the training verifier; {len(items)} fail {label} "
                           "(verdicts recorded during the run by eval.hidden_verifier)",
            "checked": checked, "items": items}
