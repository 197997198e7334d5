"""``posttrain.dotted.import_dotted``: the one ``'package.module:attr'`` plug-in loader.

Every failure is a one-line ``ValueError`` that names where the path came from (``what``) and the path.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from posttrain.dotted import import_dotted


def test_a_good_spec_returns_the_object_and_follows_dotted_attributes() -> None:
    assert import_dotted("collections:OrderedDict", what="k") is collections.OrderedDict
    assert import_dotted("os.path:join", what="k") is __import__("os").path.join
    assert import_dotted("collections:OrderedDict.fromkeys", what="k") == collections.OrderedDict.fromkeys


@pytest.mark.parametrize("spec", ["no_colon", ":attr", "mod:", ""])
def test_a_spec_without_module_and_attribute_is_refused(spec: str) -> None:
    with pytest.raises(ValueError) as e:
        import_dotted(spec, what="credit.estimator")
    assert str(e.value) == f"credit.estimator: {spec!r} must look like 'package.module:function'"


def test_the_shape_in_the_message_is_the_callers() -> None:
    with pytest.raises(ValueError, match=r"^--factory: 'x' must look like 'module:callable'$"):
        import_dotted("x", what="--factory", shape="module:callable")


def test_a_missing_module_is_one_line_naming_the_spec() -> None:
    with pytest.raises(ValueError) as e:
        import_dotted("no_such_module_zq:f", what="task.name")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("task.name: cannot import module 'no_such_module_zq' of 'no_such_module_zq:f': "
                          "ModuleNotFoundError")


def test_a_module_that_fails_at_import_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_plugin_zq.py").write_text("raise RuntimeError('boom')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"^env.name: cannot import module 'broken_plugin_zq' of "
                                             r"'broken_plugin_zq:f': RuntimeError: boom$"):
            import_dotted("broken_plugin_zq:f", what="env.name")
    finally:
        sys.modules.pop("broken_plugin_zq", None)


@pytest.mark.parametrize("attr", ["nope", "OrderedDict.nope"])
def test_a_missing_attribute_is_one_line_naming_the_spec(attr: str) -> None:
    with pytest.raises(ValueError) as e:
        import_dotted(f"collections:{attr}", what="reward.functions")
    assert str(e.value) == (f"reward.functions: module 'collections' has no attribute {attr!r} "
                            f"(from 'collections:{attr}')")
