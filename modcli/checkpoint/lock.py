"""One writer per --out: every command that writes an output (train, import, export --onnx/--hf, sweep, tokenizer
train) holds the same lock for a given --out while it writes, so a second one is refused at once.

The lock of OUT is `.OUT.modcli.lock` beside OUT (`out_lock_path`), whatever the command and whether it writes OUT
in place (train, sweep) or writes it elsewhere and renames it into place (import, export, tokenizer train): a lock
inside OUT would be moved away with the folder it guards. It is an advisory `flock` on a small file that names its
holder (pid, host, command, start time). The kernel releases a flock when its process ends, however it ends, so a
lock file left by a killed process is recognised as stale (nobody holds the flock), taken over, and reported with a
note. A process that finds the flock held is refused at once with a UserError (exit code 2) naming the holder.

Run folders written before this rule hold `RUN/.modcli.lock` (`run_lock_path`): a writer also tries that file, is
refused while a process holds it, and removes it when it is stale. Where the folder above an existing OUT may not be
written (a run folder the user owns in a folder they do not), an in-place writer locks `OUT/.modcli.lock` instead;
every other writer tries that file too, so the two still exclude each other. `sweep` takes the lock shared: several
`modcli sweep` processes may fill one sweep folder together (each point has its own lock), no other command may.

Holding the lock, `OutLock` also tidies what a killed writer left beside OUT (`.tmp-OUT-PID`, `.old-OUT-PID`,
`.trash-OUT-PID`; a displaced OUT whose replacement never arrived is put back) and reports it with a note.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from modcli.checkpoint import atomic
from modcli.errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no flock; outputs are not locked there
    fcntl = None

LOCK_NAME = ".modcli.lock"
LEFT_BESIDE = {"tmp": "an interrupted modcli command writing it", "old": "an interrupted export --force",
               "trash": "an interrupted clean-up"}
"""What leaves a `.KIND-OUT-PID` beside OUT (modcli.checkpoint.atomic.publish_folder and remove_folder)."""


def out_lock_path(out: Path) -> Path:
    """The one lock of --out OUT, for every command: `.OUT.modcli.lock` in the folder that holds OUT (that folder's
    symlinks resolved, so two spellings of one place get one lock)."""
    out = Path(os.path.abspath(out))
    if not out.name:
        raise UserError(f"--out {out}: a file system's root cannot be an output")
    return Path(os.path.realpath(out.parent)) / f".{out.name}{LOCK_NAME}"


sibling_lock_path = out_lock_path
"""The name `modcli export` has always used for its lock (now every command's)."""


def run_lock_path(run_dir: Path) -> Path:
    """The lock inside a run folder that `train` and `import` held before every command locked `out_lock_path`
    (still tried, see the module docstring)."""
    return Path(run_dir) / LOCK_NAME


class RunLock:
    """The flock at `path` for `command` on `target` (the --out named in messages); `shared` for a lock several
    processes of one command hold together (sweep). `acquire()` returns a note when it took over a stale lock."""

    def __init__(self, path: Path, command: str, target: Path, shared: bool = False) -> None:
        self.path, self.command, self.target, self.shared = path, command, target, shared
        self.fd: int | None = None
        self.remove_empty: Path | None = None
        """A folder removed at release when it is left empty (it was created for this command)."""

    def acquire(self) -> str | None:
        try:
            return self._acquire()
        except OSError as exc:
            raise UserError(f"--out {self.target}: cannot create {exc.filename or self.path}: "
                            f"{exc.strerror or exc}") from None

    def _acquire(self) -> str | None:
        """As acquire, but a file system's refusal to create the lock file is an OSError."""
        if fcntl is None:
            return None
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                alone = _flock(fd, fcntl.LOCK_EX)
                if not alone and self.shared:
                    if not _flock(fd, fcntl.LOCK_SH):
                        raise BlockingIOError
                elif not alone:
                    raise BlockingIOError
            except BlockingIOError:
                holder = describe(_read(fd))
                os.close(fd)
                raise UserError(f"--out {self.target} is in use by {holder}; wait for it to finish or pick another "
                                "--out") from None
            except OSError as exc:
                os.close(fd)
                raise UserError(f"--out {self.target}: cannot lock {self.path}: {exc.strerror}") from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)  # the holder released and removed the file between our open and flock: try again
        previous = _read(fd) if alone else None  # held shared by others: their record, not a stale one
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                  "started_unix": round(time.time(), 3)}
        if alone:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            if self.shared and not _flock(fd, fcntl.LOCK_SH):  # others of this command may join now
                holder = describe(_read(fd))  # (the change is not atomic: another took it in between)
                os.close(fd)
                raise UserError(f"--out {self.target} is in use by {holder}; wait for it to finish or pick another "
                                "--out")
        self.fd = fd
        if previous:
            return (f"note: took over the stale lock of {describe(previous)}, which ended without releasing it "
                    f"({self.path})")
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        # Remove the file only while holding the flock alone, so no one locks a file we remove.
        if not self.shared or _flock(self.fd, fcntl.LOCK_EX):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None
        if self.remove_empty is not None:
            try:
                self.remove_empty.rmdir()  # only when empty
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


class OutLock:
    """The lock of --out `out` for `command`, and the checks every writer makes first (see the module docstring).

    `kind`: what OUT must be when it exists ("run folder", "sweep folder"; None: not checked here). `in_place`: the
    command writes inside an existing OUT, so it may lock `OUT/.modcli.lock` where the folder above OUT refuses the
    lock file. `acquire()` returns the notes to print (stale locks taken over, leftovers tidied); `release()` also
    removes OUT and the folders above it that `acquire` created, when they are left empty.
    """

    def __init__(self, out: Path, command: str, kind: str | None = None, shared: bool = False,
                 in_place: bool = False) -> None:
        self.out, self.command, self.kind, self.shared, self.in_place = Path(out), command, kind, shared, in_place
        self.lock = RunLock(out_lock_path(self.out), command, self.out, shared)
        self.created: list[Path] = []
        """Folders this command created (OUT itself among them when it did not exist), removed at release if empty."""

    def acquire(self) -> list[str]:
        out = self.out
        existing = _nearest_existing(out)
        if existing != out and not existing.is_dir():
            raise UserError(f"--out {out}: {existing} is a file, not a folder")
        if existing == out and self.kind is not None and not out.is_dir():
            raise UserError(f"--out {out} is a file, not a {self.kind}")
        self.created = [p for p in [out, *out.parents] if p.is_relative_to(existing) and p != existing]
        inner = run_lock_path(out)
        try:
            note = self.lock._acquire()
        except OSError as exc:
            if not (self.in_place and out.is_dir() and exc.errno in (errno.EACCES, errno.EPERM)):
                raise UserError(f"--out {out}: cannot create {exc.filename or self.lock.path}: "
                                f"{exc.strerror or exc}") from None
            self.lock = RunLock(inner, self.command, out, self.shared)  # the folder above refuses: lock inside
            note = self.lock.acquire()
        notes = [note] if note else []
        try:
            if self.lock.path != inner and inner.is_file():
                notes += _clear_inner_lock(inner, out)
            if fcntl is not None:  # tidy only under a lock that excludes every other writer
                notes += atomic.clean_stale(out.parent, re.escape(out.name), None, LEFT_BESIDE,
                                            restored="an interrupted export --force")
        except BaseException:
            self.release()
            raise
        return notes

    def release(self) -> None:
        self.lock.release()
        for folder in self.created:  # OUT first, then the folders above it
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break

    def __enter__(self) -> list[str]:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor or ".")


def _clear_inner_lock(inner: Path, out: Path) -> list[str]:
    """A run folder's own lock (before every command locked beside OUT): refused while held, removed when stale."""
    if fcntl is None:
        return []
    try:
        fd = os.open(inner, os.O_RDWR)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UserError(f"--out {out}: cannot open {inner}: {exc.strerror or exc}") from None
    try:
        if not _flock(fd, fcntl.LOCK_EX):
            raise UserError(f"--out {out} is in use by {describe(_read(fd))}; wait for it to finish or pick another "
                            "--out")
        previous = _read(fd)
        os.unlink(inner)  # while holding its flock
    finally:
        os.close(fd)
    holder = f" of {describe(previous)}" if previous else ""
    return [f"note: removed {inner}, the stale lock{holder}, which ended without releasing it"]


def _flock(fd: int, operation: int) -> bool:
    """Take the flock without waiting: False when another process holds it (EX) or holds it exclusively (SH)."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return {"garbled": True}  # truthy: a holder was there


def describe(record: dict[str, Any] | None) -> str:
    """A lock's holder, for messages: "modcli train (pid 12 on host, since 2026-01-02 03:04:05)"."""
    if not record or "pid" not in record:
        return "another process"
    since = record.get("started_unix")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if isinstance(since, float) else ""
    return f"modcli {record.get('command', '?')} (pid {record.get('pid', '?')} on {record.get('host', '?')}{when})"
