"""``posttrain --malloc NAME|PATH COMMAND``: the flag is read anywhere, the library is found or refused in one
line, the command is started again with the library first in ``LD_PRELOAD``, and the new process says the
library is mapped only when it is (posttrain/commands/malloc_preload.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.commands.malloc_preload import (
    ENV_MARK,
    LIB_DIRS,
    LIBRARIES,
    apply_malloc_flag,
    find_allocator,
    is_mapped,
    reexec_plan,
    take_malloc_flag,
)
from posttrain.errors import UserError


@pytest.mark.parametrize("argv,value,rest", [
    (["train", "demo", "steps=3"], None, ["train", "demo", "steps=3"]),
    (["--malloc", "tcmalloc", "train", "demo"], "tcmalloc", ["train", "demo"]),
    (["train", "demo", "--malloc=jemalloc", "steps=3"], "jemalloc", ["train", "demo", "steps=3"]),
    (["bench", "memory", "--malloc", "/x/lib.so", "--updates", "3"], "/x/lib.so", ["bench", "memory", "--updates", "3"]),
])
def test_the_flag_is_read_anywhere_and_removed(argv, value, rest):
    assert take_malloc_flag(argv) == (value, rest)


@pytest.mark.parametrize("argv,msg", [
    (["train", "--malloc"], "needs a value"),
    (["--malloc", "--traceback", "train"], "needs a value"),
    (["--malloc=", "train"], "needs a value"),
    (["--malloc", "tcmalloc", "--malloc=jemalloc", "train"], "given twice"),
])
def test_a_flag_without_one_value_is_refused(argv, msg):
    with pytest.raises(UserError, match=msg):
        take_malloc_flag(argv)


def test_a_named_allocator_is_found_in_the_library_dirs_in_order(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (second / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (second / "libjemalloc.so.2").write_bytes(b"")
    assert find_allocator("tcmalloc", [str(first), str(second)]) == second / "libtcmalloc_minimal.so.4"
    (first / "libtcmalloc.so.4").write_bytes(b"")  # the full tcmalloc, in an earlier dir
    assert find_allocator("tcmalloc", [str(first), str(second)]) == first / "libtcmalloc.so.4"
    assert find_allocator("jemalloc", [str(first), str(second)]) == second / "libjemalloc.so.2"


def test_a_missing_library_is_refused_naming_the_package_to_install(tmp_path):
    with pytest.raises(UserError, match=r"apt-get install libtcmalloc-minimal4\) or pass the library's path") as e:
        find_allocator("tcmalloc", [str(tmp_path)])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"libjemalloc2"):
        find_allocator("jemalloc", [str(tmp_path)])
    with pytest.raises(UserError, match=r"/nope/libfoo\.so: no such file"):
        find_allocator("/nope/libfoo.so", [str(tmp_path)])
    with pytest.raises(UserError, match=r"unknown allocator; use one of tcmalloc, jemalloc"):
        find_allocator("mimalloc2000", [str(tmp_path)])


def test_a_library_counts_as_mapped_only_when_its_file_is(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4.5.9"
    lib.write_bytes(b"")
    link = tmp_path / "libtcmalloc_minimal.so.4"
    link.symlink_to(lib.name)
    maps = (
        "7f00-7f10 r--p 00000000 fd:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        f"7f20-7f30 r-xp 00001000 fd:01 456 {lib}\n"
        "7ffd-7ffe rw-p 00000000 00:00 0 [stack]\n"
    )
    assert is_mapped(link, maps)  # the loader maps the file the soname link resolves to
    assert is_mapped(lib, maps)
    assert not is_mapped(link, maps.replace(str(lib), "/usr/lib/libjemalloc.so.2"))
    assert not is_mapped(link, "")


def test_the_plan_runs_the_same_command_line_with_the_library_first_in_ld_preload():
    lib = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    orig = ["/v/bin/python", "-X", "utf8", "-m", "posttrain.cli", "--malloc", "tcmalloc", "train", "demo"]
    env = {"PATH": "/bin", "LD_PRELOAD": "/opt/libfoo.so " + str(lib)}
    plan = reexec_plan(lib, orig, env, "/v/bin/python3.11")
    assert plan.executable == "/v/bin/python3.11"
    # the flag stays: the new process sees it with POSTTRAIN_MALLOC set and checks the mapping
    assert plan.args == ["/v/bin/python3.11", "-X", "utf8", "-m", "posttrain.cli", "--malloc", "tcmalloc", "train", "demo"]
    assert plan.env["LD_PRELOAD"] == f"{lib}:/opt/libfoo.so"  # first, once, the user's other preloads kept
    assert plan.env[ENV_MARK] == str(lib)
    assert plan.env["PATH"] == "/bin"
    assert "LD_PRELOAD" in env and ENV_MARK not in env  # the caller's environment is not touched


def test_in_process_the_flag_is_refused_in_one_line(capsys, monkeypatch):
    """``main(argv)`` called by a program cannot replace that program's process."""
    monkeypatch.delenv(ENV_MARK, raising=False)
    lib = next((p for d in LIB_DIRS for so in LIBRARIES["tcmalloc"][0] if (p := Path(d) / so).is_file()), None)
    if lib is None:  # the refusal of a missing library is the one line then
        assert main(["--malloc", "tcmalloc", "train", "--help"]) == 2
        assert "apt-get install libtcmalloc-minimal4" in capsys.readouterr().err
        return
    assert main(["--malloc", "tcmalloc", "train", "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain: error: --malloc starts the command again in a new process") and "\n" not in err


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in (ENV_MARK, "LD_PRELOAD")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True, text=True,
                          timeout=120, env=full)


def test_a_missing_library_path_stops_the_command_in_one_line(tmp_path):
    r = _run(["train", "--malloc", str(tmp_path / "libnone.so"), "--help"])
    assert r.returncode == 2
    assert r.stderr.strip() == f"posttrain: error: --malloc {tmp_path / 'libnone.so'}: no such file"
    assert "usage" not in r.stdout


@pytest.mark.parametrize("name", ["tcmalloc", "jemalloc"])
def test_the_command_runs_again_with_the_allocator_mapped(name):
    """The real path: the process re-executes itself, the loader maps the library, and the command runs with
    its arguments. The library is a system package (.ci/run installs both); without it this says so."""
    try:
        lib = find_allocator(name)
    except UserError as e:
        pytest.skip(f"{name} is not installed here: {e}")
    r = _run(["train", "--malloc", name, "--help"])
    assert r.returncode == 0, r.stderr
    assert f"posttrain: malloc {name} ({lib}, preloaded)" in r.stderr
    assert "usage: posttrain train" in r.stdout


def test_the_check_in_the_new_process_refuses_a_library_the_loader_did_not_map(tmp_path):
    """A process that was told it runs under the library (``POSTTRAIN_MALLOC``) but has not mapped it stops
    in one line instead of claiming it."""
    fake = tmp_path / "libtcmalloc_minimal.so.4"
    fake.write_bytes(b"not an ELF file")
    r = _run(["train", "--malloc", str(fake), "--help"], env={ENV_MARK: str(fake)})
    assert r.returncode == 2
    assert f"did not load {fake}" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_off_linux_the_flag_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(UserError, match=r"^--malloc needs Linux \(LD_PRELOAD and /proc/self/maps\); this is darwin$"):
        apply_malloc_flag(["--malloc", "tcmalloc", "train"], may_exec=True)
    assert apply_malloc_flag(["train", "demo"], may_exec=True) == ["train", "demo"]  # no flag: nothing asked
