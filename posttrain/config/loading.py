"""Reading a recipe: YAML file or shipped name, dotted ``key=value`` overrides, validation into
:class:`~posttrain.config.run.RunConfig`, and the resolved config as YAML.

Overrides address nested keys with dots (``optim.lr=3e-4``) and are parsed as YAML scalars.
Unknown keys and wrong types are errors that name the key.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from posttrain.config.dead_settings import GivenKeys, check_dead_settings
from posttrain.config.run import RECORDED, RunConfig, check_new_run
from posttrain.errors import ConfigError

RECIPES_DIR = Path(__file__).parent.parent / "recipes"
_log = logging.getLogger("posttrain.config")


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, _, raw = item.partition("=")
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: bad key")
    try:
        return key.split("."), yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({getattr(e, 'problem', None) or e})") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted ``key=value`` overrides into a nested dict (values parsed as YAML scalars)."""
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for p in path[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def resolve_recipe_path(recipe: str) -> Path:
    """A path to a YAML file, or the bare name of a shipped recipe (``grpo`` -> recipes/grpo.yaml).

    A name with a path separator or a ``.yaml`` / ``.yml`` suffix is a path and must be an existing
    file: a typo in ``dir/grpo.yaml`` must not silently run the shipped ``grpo``. Only a bare name
    falls back to the shipped recipes (an existing file of that name in the working directory wins).
    """
    p = Path(recipe)
    shipped = ", ".join(sorted(q.stem for q in RECIPES_DIR.glob("*.yaml")))
    if "/" in recipe or "\\" in recipe or p.suffix in (".yaml", ".yml"):
        if p.is_file():
            return p
        why = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError(f"recipe file {recipe} {why} (shipped recipes are bare names: {shipped})")
    if p.is_file():
        return p
    cand = RECIPES_DIR / f"{recipe}.yaml"
    if cand.is_file():
        return cand
    raise ConfigError(f"recipe {recipe!r} not found (a YAML path, or one of: {shipped})")


def _format_validation(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        msg = msg.removeprefix("Value error, ")  # pydantic's prefix on a validator's ValueError
        # A whole-config check (no location) names its keys in the message itself.
        lines.append(f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}")
    return "; ".join(lines)


def read_recipe(recipe: str | None = None, overrides: list[str] | None = None) -> tuple[dict[str, Any], str]:
    """The nested mapping of a recipe (path or shipped name; None = all defaults) with ``overrides``
    applied, and its source (the file, or ``"defaults"``) that error lines start with.

    Raises :class:`ConfigError` for a missing recipe, YAML that does not parse or is not a mapping,
    and a malformed override.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if recipe is not None:
        path = resolve_recipe_path(recipe)
        source = str(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(_yaml_error(path, e)) from None
        if loaded is None:
            raise ConfigError(f"{path}: the recipe is empty (expected a mapping of keys, e.g. 'steps: 10')")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of keys, got a YAML {type(loaded).__name__}")
        data = loaded
    return apply_overrides(data, list(overrides or [])), source


def parse_config(data: dict[str, Any], source: str, overrides: Sequence[str] = ()) -> RunConfig:
    """``RunConfig`` of a nested mapping, checked from the config alone (types, bounds, combinations,
    dead settings: ``overrides`` are the ``key=value`` items typed on the command line, already applied to
    ``data``; a typed key that cannot take effect is refused even at its default value, unless that value
    switches it off); a
    :class:`ConfigError` of one line per bad key, each prefixed by ``source`` (a file, or e.g. the command
    line that built ``data``). Runs nothing and imports nothing of the run."""
    try:
        return RunConfig.model_validate(data, context={"given": GivenKeys.of(data, overrides)})
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None


def parse_recorded_config(data: dict[str, Any], source: str) -> RunConfig:
    """``RunConfig`` of a run's saved ``config.yaml`` (``data``), read as the run recorded it.

    Types, bounds and unknown keys are checked as by :func:`parse_config` (a :class:`ConfigError` line per
    bad key, prefixed by ``source``). The refusals of a new run (:func:`~posttrain.config.run.check_new_run`:
    combinations, dead settings) are not applied: reading a recorded run is not starting one, and a run
    written before a refusal existed must stay readable. When one would refuse, one warning line says so,
    naming the key. Starting or resuming a run loads its recipe with :func:`parse_config`, refusals included.
    """
    try:
        cfg = RunConfig.model_validate(data, context=RECORDED)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None
    try:
        check_new_run(cfg)
    except ValueError as e:
        _log.warning("%s: read as recorded, although a new run would now be refused: %s", source, e)
    return cfg


def log_warnings(cfg: RunConfig, source: str, given: GivenKeys | None = None) -> None:
    """Log the load-time warnings of a valid ``cfg``: the keys whose dead-settings rule warns instead of
    refusing (:data:`posttrain.config.dead_settings.RULES`; ``given``: what the user wrote and typed), and
    ``optim.lr=0`` with steps to run."""
    for line in check_dead_settings(cfg, given):
        _log.warning("%s: %s", source, line)
    if cfg.optim.lr == 0 and cfg.steps > 0:
        # Legitimate for determinism checks (weights never change), a silent no-op run otherwise.
        _log.warning("%s: optim.lr=0 with steps=%d: the policy weights will not change", source, cfg.steps)


def load_config(recipe: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a recipe (path or shipped name; None = all defaults), apply overrides, check it from the
    config alone (:func:`parse_config`), log the warnings (:func:`log_warnings`). The checks that need
    the registries, user modules or this machine are the loop's
    (:func:`posttrain.loop.validate.load_run_config`, which the commands use)."""
    data, source = read_recipe(recipe, overrides)
    cfg = parse_config(data, source, overrides or ())
    log_warnings(cfg, source, GivenKeys.of(data, overrides or ()))
    return cfg


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """One line ``file:line:column: problem`` for a YAML parse error (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def dump_config(cfg: RunConfig) -> str:
    """The fully resolved config as YAML."""
    text: str = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    return text
