"""``instructions``: the verifier of verifiable instruction following (IFEval-style constraints).

The reference is the prompt's constraint spec, a JSON list ``[{"family": ..., **params}, ...]``
(:mod:`posttrain.rewards.constraints`), never anything the response supplies. Components:

- ``ifc/<family>`` = 1.0 / 0.0 for each constraint of the prompt (partial credit, one component each;
  they vary by prompt, so a recipe weights ``ifc_mean`` rather than them),
- ``ifc_mean`` = the fraction of the prompt's constraints satisfied,
- ``task`` = 1.0 iff all are satisfied.

Status: ``correct`` iff all are satisfied, else ``wrong``; an empty (blank) response is ``invalid``
with every component 0 (it answers nothing; an empty text would satisfy "no commas" vacuously).
A response that fails a format constraint (JSON asked, none parseable) is ``wrong`` like any
other unmet constraint: the verdict is about the instructions, not about reading an answer.
This is the all-or-nothing verdict with per-constraint partial credit of Tulu 3's RLVR on
IFEval constraints (Lambert et al. 2024, arXiv:2411.15124).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from posttrain.rewards.constraints import check_spec, satisfied
from posttrain.rewards.verdict import Verdict
from posttrain.rewards.verifier import VERIFIERS
from posttrain.trajectory import Status


def parse_constraints(reference: Any) -> list[Mapping[str, Any]]:
    """The constraint specs of ``reference`` (a JSON string or a list of mappings); ``ValueError``
    saying why when it is not a non-empty list of valid specs with distinct families."""
    specs = json.loads(reference) if isinstance(reference, str) else reference
    if not isinstance(specs, list | tuple) or not specs:
        raise ValueError(f"expected a non-empty list of constraint specs, got {str(reference)[:80]!r}")
    for spec in specs:
        why = check_spec(spec)
        if why:
            raise ValueError(why)
    fams = [str(s["family"]) for s in specs]
    if len(set(fams)) != len(fams):
        raise ValueError(f"a constraint family appears twice: {fams}")
    return list(specs)


@VERIFIERS.register("instructions")
@dataclasses.dataclass(frozen=True)
class InstructionsVerifier:
    """All constraints of the reference spec checked on the response (module docstring)."""

    name: str = "instructions"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """``correct`` iff every constraint holds; components ``task``, ``ifc_mean``, ``ifc/<family>``."""
        specs = parse_constraints(reference)
        fams = [f"ifc/{s['family']}" for s in specs]
        if not response.strip():
            return Verdict(Status.INVALID, {"task": 0.0, "ifc_mean": 0.0, **dict.fromkeys(fams, 0.0)},
                           "empty response")
        ok = {f: float(satisfied(response, s)) for f, s in zip(fams, specs, strict=True)}
        n_ok = int(sum(ok.values()))
        all_ok = n_ok == len(specs)
        failed = [f[4:] for f, v in ok.items() if not v]
        why = f"{n_ok}/{len(specs)} constraints met" + (f"; failed: {', '.join(failed)}" if failed else "")
        return Verdict(Status.CORRECT if all_ok else Status.WRONG,
                       {"task": float(all_ok), "ifc_mean": n_ok / len(specs), **ok}, why)

    def check_reference(self, reference: Any) -> str | None:
        """Why the reference is not a readable constraint spec (None when it is); checked at load."""
        try:
            parse_constraints(reference)
        except ValueError as e:
            return str(e)
        return None
