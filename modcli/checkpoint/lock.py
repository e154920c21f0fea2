"""One writer per output folder: `modcli train` and `modcli export` hold a lock on their --out while they write.

The lock is an advisory `flock` on a small file that names its holder (pid, host, command, start time). The
kernel releases a flock when its process ends, however it ends, so a lock file left by a killed process is
recognised as stale (nobody holds the flock), taken over, and reported with a note. A second process that finds
the flock held is refused at once with a UserError (exit code 2) naming the holder.

`modcli train` locks `RUN/.modcli.lock` inside its run folder; `modcli export` locks `.BUNDLE.modcli.lock` next to
its bundle folder, because the bundle itself is written elsewhere and renamed into place.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from modcli.errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not locked there
    fcntl = None

LOCK_NAME = ".modcli.lock"


def run_lock_path(run_dir: Path) -> Path:
    """The lock of a run folder (`modcli train --out`)."""
    return run_dir / LOCK_NAME


def sibling_lock_path(out: Path) -> Path:
    """The lock of a folder written elsewhere and renamed into place (`modcli export --out`)."""
    return out.parent / f".{out.name}{LOCK_NAME}"


class RunLock:
    """Hold the lock at `path` for `command` on `target` (the folder named in messages); see the module docstring.

    `acquire()` returns a note when it took over a stale lock, else None. `release()` removes the lock file; with
    `remove_empty`, it also removes `remove_empty` when that folder is left empty (it was created for this run).
    """

    def __init__(self, path: Path, command: str, target: Path) -> None:
        self.path, self.command, self.target = path, command, target
        self.fd: int | None = None
        self.remove_empty: Path | None = None

    def acquire(self) -> str | None:
        if fcntl is None:
            return None
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise UserError(f"--out {self.target}: cannot create {exc.filename or self.path}: "
                                f"{exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read(fd))
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
        previous = _read(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                  "started_unix": round(time.time(), 3)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd
        if previous:
            return (f"note: took over the stale lock of {_describe(previous)}, which ended without releasing it "
                    f"({self.path})")
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding the flock, so no one locks the file we remove
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


def _read(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return {"garbled": True}  # truthy: a holder was there


def _describe(record: dict[str, Any] | None) -> str:
    if not record or "pid" not in record:
        return "another process"
    since = record.get("started_unix")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if isinstance(since, float) else ""
    return f"modcli {record.get('command', '?')} (pid {record.get('pid', '?')} on {record.get('host', '?')}{when})"
