"""``--verifier module:factory`` resolves through the one dotted-path loader (posttrain.dotted)."""

from __future__ import annotations

import pytest

from posttrain.diagnostics.second_verifier import load_verifier


def test_dotted_verifier_path_errors_name_the_flag_and_path() -> None:
    with pytest.raises(ValueError, match=r"--verifier: cannot import module 'no_such_mod_xyz'"):
        load_verifier("no_such_mod_xyz:make")
    with pytest.raises(ValueError, match=r"--verifier: module 'posttrain.dotted' has no attribute 'nope'"):
        load_verifier("posttrain.dotted:nope")


def test_dotted_verifier_factory_gets_the_kwargs() -> None:
    v = load_verifier("types:SimpleNamespace", '{"name": "mine", "version": 3}')
    assert (v.name, v.version) == ("mine", 3)
