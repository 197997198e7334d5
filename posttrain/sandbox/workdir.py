"""Host-side disk accounting and clean-up of a run's work dir (levels without a sized tmpfs)."""

from __future__ import annotations

import errno
import os
import secrets
import stat

from posttrain.sandbox.levels import WORK_IN_SANDBOX

MAX_ENTRIES = 20_000  # work-dir entries counted per check; more is itself over the limit


def disk_over(work: str, max_bytes: int) -> bool:
    """True if the tree under ``work`` uses more than ``max_bytes`` or ``MAX_ENTRIES`` entries
    (or cannot be measured: too deep a path). Iterative; never raises."""
    used, seen, stack = 0, 0, [work]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    seen += 1
                    st = e.stat(follow_symlinks=False)
                    used += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
                    if used > max_bytes or seen > MAX_ENTRIES:
                        return True
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                return True
            continue
    return False


def tmpfs_inodes_over(bwrap_pid: int) -> bool:
    """True if bwrap's ``/work`` or ``/tmp`` tmpfs holds more than ``MAX_ENTRIES`` inodes.

    bwrap cannot set ``nr_inodes``, and empty files cost kernel memory outside every limit, so the
    host counts them through the sandbox's root (``/proc/INIT/root``, INIT being bwrap's first
    child). Unmeasurable (process gone, no access): False; the size limit still holds."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            kids = f.read().split()
        for kid in kids[:1]:
            for d in (WORK_IN_SANDBOX, "/tmp"):
                st = os.statvfs(f"/proc/{kid}/root{d}")
                if st.f_files - st.f_ffree > MAX_ENTRIES:
                    return True
    except OSError:
        pass
    return False


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_OPEN = 64  # directory fds held while descending; deeper subtrees are moved up first


def remove_tree(path: str) -> bool:
    """Delete ``path`` whatever the program made of it (any depth, any permissions, symlinks,
    names); True if it is gone. Never raises: a failure is returned (and warned by the caller).

    Works on directory fds (never on long paths, never following symlinks, never via ``..``),
    iteratively, with at most ``_MAX_OPEN`` fds: a subtree deeper than that is renamed to a
    direct child of the top first, which makes every chain shorter.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return True
        os.chmod(path, 0o700)  # the program may have made its own work dir unreadable
        top = os.open(path, _DIR_FLAGS)
    except OSError:
        return False
    try:
        _empty_dir(top)
    except OSError:
        pass
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        return not os.path.lexists(path)
    return True


def _empty_dir(top: int) -> None:
    stack: list[tuple[int, str]] = [(top, "")]  # (fd, its name in the parent)
    skipped: set[tuple[int, int]] = set()
    moved = 0
    try:
        while stack:
            cur = stack[-1][0]
            try:
                os.fchmod(cur, 0o700)
            except OSError:
                pass
            sub: str | None = None
            with os.scandir(cur) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            if (st.st_dev, st.st_ino) not in skipped:
                                sub = e.name
                                key = (st.st_dev, st.st_ino)
                                break
                        else:
                            os.unlink(e.name, dir_fd=cur)
                    except OSError:
                        pass
            if sub is not None:
                if len(stack) >= _MAX_OPEN:
                    moved += 1
                    try:
                        os.rename(sub, f".rm-{moved}-{secrets.token_hex(4)}", src_dir_fd=cur, dst_dir_fd=top)
                    except OSError:
                        skipped.add(key)
                    continue
                try:
                    nxt = os.open(sub, _DIR_FLAGS, dir_fd=cur)
                except OSError:
                    try:
                        os.chmod(sub, 0o700, dir_fd=cur)
                        nxt = os.open(sub, _DIR_FLAGS, dir_fd=cur)
                    except OSError:
                        skipped.add(key)
                        continue
                stack.append((nxt, sub))
                continue
            if len(stack) == 1:
                return
            fd, name = stack.pop()
            try:
                key = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=stack[-1][0])
            except OSError:
                skipped.add(key)
    finally:
        for fd, _ in stack[1:]:
            os.close(fd)


__all__ = ["MAX_ENTRIES", "disk_over", "remove_tree", "tmpfs_inodes_over"]
