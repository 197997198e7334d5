"""An evaluation-only ("hidden") verifier: a second judge that never touches the reward.

A policy that games its verifier shows first in the trajectories with a high reward that an
independent judge fails: audit those first. ``eval.hidden_verifier`` names one (a registered verifier or
``module.path:factory``, with ``eval.hidden_verifier_kwargs``); the run re-judges every training
response and every held-out response with it, through the same guarded verification path as the
training verifier (a crash or a hang is ``infra_error``, never a failure of the response), and
records its verdicts beside the training verifier's: per trajectory in the ledger
(``hidden_verifier``, ``hidden_status``, ``meta.hidden_explanation``), per evaluation in the
metrics (``heldout/hidden/*``). Rewards, advantages and the update never read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.trajectory import Status, Trajectory

KEY = "eval.hidden_verifier"


def build_hidden_verifier(spec: str, kwargs: Mapping[str, Any] | None = None) -> Any:
    """The verifier named by ``spec``: a registered name (``exact``, ``math`` ...) or ``module.path:factory``.

    ``kwargs`` go to the registry constructor or the factory. Raises ``ValueError`` (one line naming
    ``eval.hidden_verifier`` / ``eval.hidden_verifier_kwargs``) for an unknown name, a bad path,
    arguments the constructor refuses, or an object without ``name``, ``version`` and ``verify``.
    """
    from posttrain.algos.hyperparameters import validated_factory_kwargs
    from posttrain.dotted import import_dotted

    kw = dict(kwargs or {})
    if ":" in spec:
        factory = import_dotted(spec, what=KEY)
        where = f"{KEY}={spec!r}"
    else:
        import posttrain.rewards  # noqa: F401 - registers the built-in verifiers
        from posttrain.rewards.verifier import VERIFIERS

        if spec not in VERIFIERS:
            raise ValueError(f"{KEY}: unknown verifier {spec!r}; registered: {', '.join(sorted(VERIFIERS))} "
                             "(or give module.path:factory)")
        factory, where = VERIFIERS[spec], f"{KEY}={spec!r}"
    kw = validated_factory_kwargs(factory, kw, key=f"{KEY}_kwargs", what=where)
    try:
        verifier = factory(**kw)
    except Exception as e:  # noqa: BLE001 - whatever the constructor refuses is a config error
        raise ValueError(f"{KEY}_kwargs: {where} refused {kw}: {type(e).__name__}: {e}") from None
    missing = [a for a in ("name", "version", "verify") if not hasattr(verifier, a)]
    if missing:
        raise ValueError(f"{KEY}: {where} built a {type(verifier).__name__} without {', '.join(missing)} "
                         "(a verifier needs name, version and verify(response, reference))")
    return verifier


def _context(verifier: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    # A verifier that asks for the prompt (wants_prompt) gets what the ledger holds of it.
    if getattr(verifier, "wants_prompt", False):
        return {"prompt": str(meta.get("prompt", "")), "meta": dict(meta)}
    return {}


def judge_trajectories(trajectories: Sequence[Trajectory], verifier: Any | None,
                       verify_batch: Callable[[list[tuple[Any, str, Any, dict[str, Any]]]], list[Any]] | None = None,
                       ) -> list[Trajectory]:
    """``trajectories`` with the hidden verifier's verdict set; unchanged when ``verifier`` is None.

    Each trajectory whose ``meta`` holds ``response`` and ``reference`` (what scoring records; the
    reference in its string form) is re-judged; the others keep ``hidden_status = None``.
    ``verify_batch`` is the run's guarded verification (``VerifierPool.verify_batch``); without it
    an in-process ``VerifierPool(workers=0)`` is used. Sets ``hidden_verifier`` (``name@version``),
    ``hidden_status`` and ``meta["hidden_explanation"]`` (first 500 characters); the reward, status
    and every other field are left as they were.
    """
    if verifier is None:
        return list(trajectories)
    from posttrain.rewards.pool import VerifierPool

    todo = [i for i, t in enumerate(trajectories) if "response" in t.meta and "reference" in t.meta]
    if verify_batch is None:
        verify_batch = VerifierPool(workers=0).verify_batch
    verdicts = verify_batch([(verifier, str(trajectories[i].meta["response"]), trajectories[i].meta["reference"],
                              _context(verifier, trajectories[i].meta)) for i in todo]) if todo else []
    label = f"{verifier.name}@{verifier.version}"
    out = list(trajectories)
    for i, v in zip(todo, verdicts, strict=True):
        t = out[i]
        out[i] = t.replace(hidden_verifier=label, hidden_status=Status(v.status),
                           meta={**t.meta, "hidden_explanation": str(v.explanation)[:500]})
    return out


def heldout_metrics(train_statuses: Sequence[Status], hidden_statuses: Sequence[Status]) -> dict[str, float]:
    """Held-out figures of the hidden verifier over the same responses (paired by position).

    ``accuracy``: share ``correct`` among the hidden verdicts that are not ``infra_error``;
    ``train_pass_hidden_fail``: responses the training verifier passed and the hidden one judged
    (not infra_error) otherwise; ``agreement``: share of responses both judged (neither infra_error)
    on which they agree about ``correct``; ``infra_errors``: hidden verifier failures.
    """
    if len(train_statuses) != len(hidden_statuses):
        raise ValueError(f"{len(train_statuses)} training verdicts for {len(hidden_statuses)} hidden ones")
    infra = Status.INFRA_ERROR
    valid = [h for h in hidden_statuses if h is not infra]
    both = [(t, h) for t, h in zip(train_statuses, hidden_statuses, strict=True) if t is not infra and h is not infra]
    nan = float("nan")
    return {
        "accuracy": sum(h is Status.CORRECT for h in valid) / len(valid) if valid else nan,
        "train_pass_hidden_fail": float(sum(t is Status.CORRECT and h is not Status.CORRECT for t, h in both)),
        "agreement": sum((t is Status.CORRECT) == (h is Status.CORRECT) for t, h in both) / len(both) if both else nan,
        "infra_errors": float(len(hidden_statuses) - len(valid)),
    }
