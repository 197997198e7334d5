"""The in-sandbox half of :mod:`posttrain.sandbox` (stdlib only, Python >= 3.8).

The host runs this file's source as ``python -I -S -c SOURCE CONFIG_JSON`` inside the sandbox.
It is two processes, so that the program under test never shares an interpreter with the code
that judges it:

*harness* (the process started by the host)
    Writes ``{"ready": true}`` on the report fd first (the host's proof that the sandbox came up:
    no program code has run yet, so a missing handshake is the sandbox's failure, never the
    program's). Reads the files from the control fd, makes itself non-dumpable (so that no
    process of the same uid can ptrace it or open its ``/proc/PID/{mem,fd,environ}``), forks the
    *solution* child, drops to its own uid where the host gave one, and only then reads the
    nonce and the tests from the control fd: they never exist in the child's memory. It runs each
    test in its own interpreter; names the solution defined resolve to :class:`Remote` proxies, so
    ``assert f(2) == 4`` calls ``f`` in the child and compares the returned plain value here, with
    real builtins. It writes the one report line (with the nonce) on the report fd.
*solution* (the forked child)
    Closes every fd except stdio and its two RPC pipe ends, drops to the solution uid where
    given, applies the rlimits, runs ``main.py`` as ``__main__`` and then answers RPC requests.
    Whatever it sends is treated as untrusted data: values are decoded from a tagged JSON of
    builtin types only (:func:`encode`), never unpickled; an object of any other type stays in the
    child and is only reachable through a proxy whose ``==`` is identity.

CONFIG_JSON (visible in ``/proc/PID/cmdline``, so it holds nothing secret): ``ctl`` (control fd),
``rep`` (report fd), ``uids`` (``[harness_uid, solution_uid]`` or null), ``limits``.
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import struct
import sys
from collections.abc import Callable
from typing import Any, NoReturn

MAX_FRAME = 8 << 20  # bytes of one RPC message; a bigger value is an error in the child
MAX_DEPTH = 100  # nesting of an encoded value
_PR_SET_DUMPABLE = 4


class ChildGone(BaseException):
    """The solution process closed its pipe (died). A BaseException so that a test's
    ``except Exception`` cannot swallow it."""


class ProtocolError(Exception):
    """The solution sent something that is not a well-formed message."""


class SolutionError(Exception):
    """An exception raised in the solution whose type is not a builtin ``Exception``."""

    def __init__(self, type_name: str, msg: str) -> None:
        super().__init__(msg)
        self.remote_type = type_name


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (pipes may take partial writes)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, n: int) -> bytes:
    """Exactly ``n`` bytes from ``fd``; raises :class:`ChildGone` at end of file."""
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise ChildGone("end of file")
        buf += chunk
    return bytes(buf)


def send_frame(fd: int, obj: Any) -> None:
    """One length-prefixed JSON message; ``ValueError`` if it is over :data:`MAX_FRAME`."""
    data = json.dumps(obj).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"message of {len(data)} bytes is over the {MAX_FRAME} byte limit")
    write_all(fd, struct.pack(">I", len(data)) + data)


def recv_frame(fd: int) -> Any:
    """The next message from ``fd`` (:class:`ChildGone` at EOF, :class:`ProtocolError` if malformed)."""
    (n,) = struct.unpack(">I", read_exact(fd, 4))
    if n > MAX_FRAME:
        raise ProtocolError(f"message of {n} bytes is over the limit")
    try:
        return json.loads(read_exact(fd, n))
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"malformed message: {type(e).__name__}") from None


_SEQ: dict[type, str] = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_SEQ_BACK: dict[str, type] = {v: k for k, v in _SEQ.items()}


def encode(v: Any, other: Callable[[Any], Any], depth: int = 0) -> Any:
    """``v`` as tagged JSON. Only exact builtin types are values (a subclass could redefine
    ``__eq__``); anything else becomes ``other(v)`` (a handle, or an error)."""
    t = type(v)
    if v is None:
        return ["n"]
    if t is bool:
        return ["b", v]
    if t is int:
        return ["i", hex(v)]  # hex: no int/str digit limit, unlike decimal
    if t is float:
        return ["f", v.hex()]
    if t is complex:
        return ["c", v.real.hex(), v.imag.hex()]
    if t is str:
        return ["s", v]
    if t is bytes or t is bytearray:
        return ["y" if t is bytes else "Y", v.hex()]
    if depth > MAX_DEPTH and (t in _SEQ or t is dict):
        raise ValueError("value nested too deeply to return")
    if t in _SEQ:
        return [_SEQ[t], [encode(x, other, depth + 1) for x in v]]
    if t is dict:
        return ["d", [[encode(k, other, depth + 1), encode(x, other, depth + 1)] for k, x in v.items()]]
    return other(v)


def decode(x: Any, handle: Callable[[int], Any], depth: int = 0) -> Any:
    """Inverse of :func:`encode`; ``handle(i)`` turns ``["h", i]`` into an object. Raises
    :class:`ProtocolError` for anything malformed."""
    if type(x) is not list or not x or type(x[0]) is not str or depth > 2 * MAX_DEPTH + 2:
        raise ProtocolError("malformed value")
    tag, rest = x[0], x[1:]
    try:
        if tag == "n" and not rest:
            return None
        if tag == "b" and type(rest[0]) is bool:
            return rest[0]
        if tag == "i" and type(rest[0]) is str:
            return int(rest[0], 16)
        if tag == "f" and type(rest[0]) is str:
            return float.fromhex(rest[0])
        if tag == "c" and type(rest[0]) is str and type(rest[1]) is str:
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        if tag == "s" and type(rest[0]) is str:
            return rest[0]
        if tag in ("y", "Y") and type(rest[0]) is str:
            return (bytes if tag == "y" else bytearray).fromhex(rest[0])
        if tag in _SEQ_BACK and type(rest[0]) is list:
            return _SEQ_BACK[tag](decode(e, handle, depth + 1) for e in rest[0])
        if tag == "d" and type(rest[0]) is list:
            out = {}
            for pair in rest[0]:
                if type(pair) is not list or len(pair) != 2:
                    raise ProtocolError("malformed dict item")
                out[decode(pair[0], handle, depth + 1)] = decode(pair[1], handle, depth + 1)
            return out
        if tag == "h" and type(rest[0]) is int:
            return handle(rest[0])
    except (IndexError, ValueError, TypeError, OverflowError, RecursionError):
        pass
    raise ProtocolError(f"malformed value with tag {tag[:8]!r}")


def exc_info(e: BaseException) -> dict[str, Any]:
    """The plain-data description of an exception that goes into reports."""
    return {"type": getattr(e, "remote_type", type(e).__name__), "msg": str(e)[:300],
            "errno": getattr(e, "errno", None) if isinstance(getattr(e, "errno", None), int) else None}


def _set_dumpable(on: bool) -> None:
    # Why ctypes: prctl has no stdlib wrapper; without it a same-uid process could read our memory.
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, int(on), 0, 0, 0)


def _drop(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


# ---------------------------------------------------------------- the solution child (untrusted)


def _flush() -> None:
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except BaseException:
            pass


def _solution(cfg: dict[str, Any], req_r: int, res_w: int) -> NoReturn:
    """Run main.py, then serve RPC requests until the harness closes the request pipe."""
    try:
        keep = sorted({0, 1, 2, req_r, res_w})
        for i, lo in enumerate(keep):  # every other fd: the control and report fds first of all
            os.closerange(lo + 1, keep[i + 1] if i + 1 < len(keep) else 1 << 20)
        if cfg["uids"]:
            _drop(cfg["uids"][1])
        lim, R = cfg["limits"], resource
        for r, soft, hard in ((R.RLIMIT_CPU, lim["cpu"], lim["cpu"] + 1), (R.RLIMIT_AS, lim["mem"], lim["mem"]),
                              (R.RLIMIT_FSIZE, lim["fsize"], lim["fsize"]),
                              (R.RLIMIT_NPROC, lim["nproc"], lim["nproc"]),
                              (R.RLIMIT_NOFILE, lim["nofile"], lim["nofile"]), (R.RLIMIT_CORE, 0, 0)):
            R.setrlimit(r, (soft, hard))
        me = os.getpid()
        g: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        try:
            with open("main.py") as f:
                code = compile(f.read(), "main.py", "exec")
        except SyntaxError as e:
            send_frame(res_w, {"main": "syntax_error", "error": exc_info(e), "line": e.lineno})
            os._exit(3)
        try:
            exec(code, g)
        except SystemExit as e:
            _flush()
            if os.getpid() == me:  # a process the program forked never speaks for it
                send_frame(res_w, {"main": "exit", "code": str(e.code)[:100]})
            os._exit(4)
        except BaseException as e:
            _flush()
            if os.getpid() == me:
                send_frame(res_w, {"main": "exception", "error": exc_info(e)})
            os._exit(1)
        _flush()
        if os.getpid() != me:
            os._exit(0)
        send_frame(res_w, {"main": "ok", "names": [k for k in g if type(k) is str]})
        _serve(g, req_r, res_w)
    except BaseException:
        pass
    _flush()
    os._exit(1)


def _serve(g: dict[str, Any], req_r: int, res_w: int) -> None:
    handles: list[Any] = []

    def keep(v: Any) -> list[Any]:
        handles.append(v)
        return ["h", len(handles) - 1]

    def arg(x: Any) -> Any:
        return decode(x, handles.__getitem__)

    while True:
        try:
            msg = recv_frame(req_r)
        except ChildGone:
            _flush()
            os._exit(0)
        try:
            op = msg["op"]
            obj: Any = handles[msg["h"]] if "h" in msg else None
            if op == "global":
                v = g[msg["name"]]
            elif op == "getattr":
                v = getattr(obj, msg["name"])
            elif op == "call":
                v = obj(*[arg(a) for a in msg["args"]], **{k: arg(a) for k, a in msg["kwargs"]})
            elif op == "getitem":
                v = obj[arg(msg["key"])]
            elif op == "contains":
                v = arg(msg["key"]) in obj
            else:
                unary: dict[str, Callable[[Any], Any]] = {"iter": iter, "next": next, "len": len, "bool": bool,
                                                          "str": str, "repr": repr}
                v = unary[op](obj)
            reply = {"ok": encode(v, keep)}
        except BaseException as e:
            reply = {"err": exc_info(e)}
        _flush()  # the program's prints reach the host before the reply that follows them
        try:
            send_frame(res_w, reply)
        except ValueError as e:
            send_frame(res_w, {"err": exc_info(e)})


# ---------------------------------------------------------------- the harness (trusted)


class _Conn:
    """The harness' end of the RPC pipes; dead for good after the first :class:`ChildGone`."""

    def __init__(self, req_w: int, res_r: int) -> None:
        self.req_w, self.res_r, self.dead = req_w, res_r, False

    def first(self) -> dict[str, Any]:
        msg = self._recv()
        if type(msg) is not dict or msg.get("main") not in ("ok", "syntax_error", "exception", "exit"):
            raise ProtocolError("malformed first message")
        return msg

    def ask(self, req: dict[str, Any]) -> Any:
        if self.dead:
            raise ChildGone("solution process is gone")
        try:
            send_frame(self.req_w, req)
        except OSError:
            self.dead = True
            raise ChildGone("solution process is gone") from None
        msg = self._recv()
        if type(msg) is dict and "ok" in msg:
            return decode(msg["ok"], lambda h: Remote(self, h))
        err = msg.get("err") if type(msg) is dict else None
        if type(err) is not dict:
            raise ProtocolError("malformed reply")
        _raise(err)

    def _recv(self) -> Any:
        try:
            return recv_frame(self.res_r)
        except ChildGone:
            self.dead = True
            raise


def _raise(err: dict[str, Any]) -> NoReturn:
    name, msg = str(err.get("type"))[:100], str(err.get("msg"))[:300]
    t = getattr(builtins, name, None)
    # Only builtin Exception types are rebuilt (so `except ValueError` in a test works); a claimed
    # SystemExit or KeyboardInterrupt must not unwind the harness.
    if isinstance(t, type) and issubclass(t, Exception):
        try:
            e = t(msg)
        except Exception:
            e = SolutionError(name, msg)
    else:
        e = SolutionError(name, msg)
    raise e


def _arg(v: Any) -> Any:
    def other(o: Any) -> Any:
        if type(o) is Remote:
            return ["h", object.__getattribute__(o, "_h")]
        raise TypeError(f"a test can pass only builtin values to the solution, not {type(o).__name__}")

    return encode(v, other)


class Remote:
    """An object that lives in the solution process. Calls, attributes, iteration, ``len``,
    ``str``, ``repr``, ``bool``, ``[]`` and ``in`` are forwarded; results come back as plain values
    or further proxies. ``==`` is identity: the solution's ``__eq__`` is never consulted."""

    __slots__ = ("_c", "_h")

    def __init__(self, conn: _Conn, h: int) -> None:
        object.__setattr__(self, "_c", conn)
        object.__setattr__(self, "_h", h)

    def _ask(self, op: str, **kw: Any) -> Any:
        return object.__getattribute__(self, "_c").ask({"op": op, "h": object.__getattribute__(self, "_h"), **kw})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ask("call", args=[_arg(a) for a in args], kwargs=[[k, _arg(a)] for k, a in kwargs.items()])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __iter__(self) -> Any:
        return self._ask("iter")

    def __next__(self) -> Any:
        return self._ask("next")

    def __len__(self) -> int:
        n = self._ask("len")
        if type(n) is not int:
            raise TypeError("len() of a solution object must be an int")
        return n

    def __bool__(self) -> bool:
        return self._ask("bool") is True

    def __str__(self) -> str:
        return str(self._ask("str"))

    def __repr__(self) -> str:
        return str(self._ask("repr"))

    def __getitem__(self, key: Any) -> Any:
        return self._ask("getitem", key=_arg(key))

    def __contains__(self, key: Any) -> bool:
        return self._ask("contains", key=_arg(key)) is True


class _TestGlobals(dict):  # type: ignore[type-arg]
    """Test globals: builtins are the harness' own; a standard-library module the solution
    imported is the harness' own import of it (else a test computing its expected value with
    ``math.sqrt`` would use the solution's, patched, ``math``); other names the solution defined
    are proxies. Names a test defines or imports itself are plain entries and win."""

    def __init__(self, conn: _Conn, names: set[str]) -> None:
        super().__init__()
        self.conn, self.names = conn, names

    def __missing__(self, name: str) -> Any:
        if name in self.names and not hasattr(builtins, name):
            if name in getattr(sys, "stdlib_module_names", ()):
                import importlib

                return importlib.import_module(name)
            return self.conn.ask({"op": "global", "name": name})
        raise KeyError(name)


def _report(rep: int, d: dict[str, Any]) -> None:
    write_all(rep, (json.dumps(d) + "\n").encode())


def _wait_status(pid: int) -> dict[str, Any]:
    # Bounded: after a malformed message the child may still run (and the host's deadline rules).
    import time

    for _ in range(100):
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        return {"exit": None}
    if os.WIFSIGNALED(st):
        return {"signal": os.WTERMSIG(st)}
    return {"exit": os.WEXITSTATUS(st) if os.WIFEXITED(st) else None}


def main() -> None:
    """Entry point inside the sandbox (see the module docstring)."""
    cfg = json.loads(sys.argv[1])
    rep, ctl, uids = cfg["rep"], cfg["ctl"], cfg["uids"]
    _report(rep, {"ready": True})
    try:
        (n,) = struct.unpack(">Q", read_exact(ctl, 8))
        files = json.loads(read_exact(ctl, n))
        for name, text in files.items():
            parent = os.path.dirname(name)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(name, "w") as f:
                f.write(text)
        if uids:
            for root, dirs, fs in os.walk("."):
                for x in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in fs)]:
                    os.chown(x, uids[1], uids[1])
        _set_dumpable(False)
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
    except BaseException as e:
        # Nothing of the program has run yet: this is the sandbox failing.
        _report(rep, {"outcome": "sandbox_error", "reason": f"harness setup: {type(e).__name__}: {e}"[:300]})
        os._exit(2)
    if pid == 0:
        os.close(req_w)
        os.close(res_r)
        _solution(cfg, req_r, res_w)
    os.close(req_r)
    os.close(res_w)
    if uids:
        _drop(uids[0])
        _set_dumpable(False)  # a uid change resets it
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    (n,) = struct.unpack(">Q", read_exact(ctl, 8))
    secret = json.loads(read_exact(ctl, n))
    os.close(ctl)
    nonce, tests = secret["nonce"], secret["tests"]
    conn = _Conn(req_w, res_r)
    out: dict[str, Any] = {"nonce": nonce}
    try:
        first = conn.first()
    except (ChildGone, ProtocolError) as e:
        os.close(req_w)
        out.update(outcome="died", why=type(e).__name__, **_wait_status(pid))
        _report(rep, out)
        os._exit(0)
    if first["main"] != "ok":
        # The child wrote these: only plain, bounded fields go on to the host.
        err, line = first.get("error"), first.get("line")
        out.update(outcome=first["main"], code=str(first.get("code"))[:100],
                   line=line if type(line) is int else None,
                   error=None if type(err) is not dict else {
                       "type": str(err.get("type"))[:100], "msg": str(err.get("msg"))[:300],
                       "errno": err.get("errno") if type(err.get("errno")) is int else None})
        _report(rep, out)
        os._exit(0)
    names = {n for n in first.get("names") or () if type(n) is str}
    results: list[dict[str, Any] | None] = []
    for i, t in enumerate(tests):
        g = _TestGlobals(conn, names)
        try:
            exec(compile(t, f"test_{i}", "exec"), g)
            results.append(None)
        except ChildGone:
            break
        except BaseException as e:
            results.append(exc_info(e))
        if conn.dead:
            break
    os.close(req_w)  # the child's serve loop ends
    if conn.dead:
        out.update(outcome="died", tests=results, **_wait_status(pid))
    else:
        out.update(outcome="ok", tests=results)
    _report(rep, out)
    os._exit(0)


if __name__ == "__main__":
    main()
