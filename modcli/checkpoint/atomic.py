"""Publishing files and folders atomically: checkpoints (modcli.checkpoint.store), export bundles
(modcli.bundle.writer) and corpus caches (modcli.data.corpus).

A folder is written under a temporary name next to its final place (`.tmp-NAME-PID`); every file and the folder
are fsynced, an optional completion marker (the sha256 and size of every file) is written last, and one
`os.replace` puts the folder in place. A folder already there is moved aside first (`.old-NAME-PID`) and deleted
once the new one is in place. On any failure the temporary folder is removed and a displaced folder is put back, so
the final path holds the old folder or the new one, never a part of either. A folder is deleted by renaming it to
`.trash-NAME-PID` first, so a kill midway leaves nothing half-deleted under its name. What a killed writer left is
tidied by `clean_stale`, called while holding the writer's lock (modcli.checkpoint.lock).

A command that publishes its --out passes `expect`, what it found there when it checked it (`folder_state`): the
folder is put in place with a rename that never replaces what appeared meanwhile (`rename_noreplace`), and a folder
it replaces must still be the one it checked; otherwise nothing is published, what is there is left as it is, and
the command stops with FolderChanged (exit code 2). Published files get the permissions the umask gives a new file
(safetensors writes its files 0600).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from modcli_runtime.bundle import sha256_of

from modcli.errors import UserError

ANYTHING = object()
"""`publish_folder(expect=ANYTHING)`: replace whatever is at the final path (a checkpoint saved again, under its
run's lock)."""


class FolderChanged(UserError):
    """What a command checked at its --out changed before it published there: nothing was published."""


def _no_pause() -> None:
    pass


def temporary_path(final: Path, kind: str) -> Path:
    """Where this process works on `final`: kind "tmp" (being written), "old" (displaced), "trash" (being deleted)."""
    return final.parent / f".{kind}-{final.name}-{os.getpid()}"


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def folder_state(path: Path) -> tuple | None:
    """What `publish_folder(expect=...)` compares: None when nothing is at `path`, else the folder's identity and
    the name, size and modification time of everything directly in it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    entries: list[tuple[str, int, int]] = []
    if os.path.isdir(path):
        with os.scandir(path) as it:
            for entry in it:
                info = entry.stat(follow_symlinks=False)
                entries.append((entry.name, info.st_size, info.st_mtime_ns))
    else:  # a file (publish_file): its own size and time
        entries.append(("", st.st_size, st.st_mtime_ns))
    return st.st_dev, st.st_ino, st.st_mode, tuple(sorted(entries))


def _unchanged(path: Path, expect: tuple) -> bool:
    return folder_state(path) == expect


def changed_message(final: Path, expect: tuple | None) -> str:
    what = ("was created by another program" if expect is None else "was changed by another program")
    return (f"--out {final} {what} after this command checked it; it is left as it is and nothing was written "
            "there (this command's own files were removed)")


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.renameat2
    except (OSError, AttributeError):
        return None


_renameat2_fn = _renameat2()


def rename_noreplace(source: Path, target: Path) -> None:
    """Rename `source` to `target`, or raise FileExistsError when anything is at `target` (an empty folder
    included, which `os.rename` would replace). Linux's renameat2(RENAME_NOREPLACE) makes it one step; elsewhere
    the check and the rename are two."""
    if _renameat2_fn is not None:
        if _renameat2_fn(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # else: no such flag on this file system
            if code in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(code, os.strerror(code), str(target))
            raise OSError(code, os.strerror(code), str(source), None, str(target))
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)


def umask() -> int:
    """The process's umask, read without changing it where /proc says it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: Path, mask: int | None = None) -> None:
    """Give a written file the permissions any new file gets (0644 under the usual umask 022): some writers
    (safetensors) create theirs 0600."""
    os.chmod(path, 0o666 & ~(umask() if mask is None else mask))


@contextmanager
def publish_folder(final: Path, marker: str | None = None, pause: Callable[[], None] = _no_pause,
                   expect: tuple | None | object = ANYTHING) -> Iterator[Path]:
    """`with publish_folder(final) as tmp:` fill the empty folder `tmp`; when the block ends, it replaces `final`.

    `marker`: the name of a completion file written last, holding {"complete": true, "files": {name: {"sha256",
    "bytes"}}} for every other file. `pause` is called between the steps (a test hook that lets a test kill the
    writer at each moment). `expect`: what the caller found at `final` when it checked it (`folder_state`; None:
    nothing); when `final` is not that any more, FolderChanged is raised and `final` is left as it is. An
    exception in the block or while publishing removes `tmp`, puts a displaced `final` back, and propagates.
    """
    tmp, old = temporary_path(final, "tmp"), temporary_path(final, "old")
    displaced = False
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        pause()
        tmp.mkdir()
        yield tmp
        files = {}
        mask = umask()
        for child in sorted(tmp.iterdir()):
            if child.is_dir():  # a folder published inside (an import's checkpoint): fsynced when it was
                fsync_dir(child)
                continue
            honour_umask(child, mask)
            fsync_file(child)
            if marker is not None:
                files[child.name] = {"sha256": sha256_of(child), "bytes": child.stat().st_size}
        if marker is not None:
            pause()
            (tmp / marker).write_text(json.dumps({"complete": True, "files": files}, indent=2) + "\n")
            fsync_file(tmp / marker)
        fsync_dir(tmp)
        pause()
        if expect is not ANYTHING and not _unchanged(final, expect):
            raise FolderChanged(changed_message(final, expect))
        if os.path.lexists(final):  # replaced: swap, then remove the old folder
            os.replace(final, old)
            displaced = True
            if expect is not ANYTHING and folder_state(old)[1:] != expect[1:]:  # changed between check and move
                rename_noreplace(old, final)
                displaced = False
                raise FolderChanged(changed_message(final, expect))
            pause()
        try:
            if expect is ANYTHING:
                os.replace(tmp, final)
            else:
                rename_noreplace(tmp, final)
        except FileExistsError:
            raise FolderChanged(changed_message(final, None if displaced else expect)) from None
        fsync_dir(final.parent)
        if displaced:
            displaced = False
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if displaced and os.path.isdir(old) and not os.path.lexists(final):
            os.replace(old, final)
        raise


def remove_folder(folder: Path, pause: Callable[[], None] = _no_pause) -> None:
    """Delete `folder`: renamed to `.trash-` first, so a kill while deleting leaves no half-deleted folder under its
    name (clean_stale removes the rest)."""
    trash = temporary_path(folder, "trash")
    os.replace(folder, trash)
    pause()
    shutil.rmtree(trash)


def clean_stale(parent: Path, name: str, marker: str | None, removed: dict[str, str], restored: str) -> list[str]:
    """Tidy what interrupted writers left in `parent`; returns one note per folder handled.

    Call only while holding the writer's lock (nothing is being written). `name`: a regex of the final folders'
    names; a displaced folder (`.old-`) whose final folder is missing is put back when it holds `marker` (None: when
    it holds anything; `restored` says what left it), and every other temporary folder (or file) of the kinds in
    `removed` (kind -> what left it) is deleted.
    """
    notes: list[str] = []
    if not parent.is_dir():
        return notes
    pattern = re.compile(rf"^\.(?P<kind>{'|'.join(removed)})-(?P<final>{name})-\d+$")
    for path in sorted(parent.iterdir()):
        match = pattern.match(path.name)
        if match is None or path.is_symlink():
            continue
        kind, final = match["kind"], parent / match["final"]
        if not path.is_dir():
            if kind == "tmp" and path.is_file():  # a file written elsewhere then renamed (publish_file)
                path.unlink()
                notes.append(f"note: removed the stale temporary file {path} ({removed[kind]})")
            continue
        complete = (path / marker).is_file() if marker is not None else any(path.iterdir())
        if kind == "old" and complete and not os.path.lexists(final):
            os.replace(path, final)
            notes.append(f"note: restored {final} from {path.name}, left by {restored}")
            continue
        shutil.rmtree(path, ignore_errors=True)
        notes.append(f"note: removed the stale temporary folder {path} ({removed[kind]})")
    return notes


@contextmanager
def publish_file(final: Path, expect: tuple | None = None) -> Iterator[Path]:
    """`with publish_file(final) as tmp:` write the file `tmp`; when the block ends it is fsynced and renamed to
    `final`. `expect`: what the caller found at `final` when it checked it (`folder_state`; None: nothing, and then
    nothing that appears meanwhile is replaced); otherwise FolderChanged, `final` left as it is, `tmp` removed."""
    tmp = temporary_path(final, "tmp")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        honour_umask(tmp)
        fsync_file(tmp)
        if folder_state(final) != expect:
            raise FolderChanged(changed_message(final, expect))
        try:
            if expect is None:
                rename_noreplace(tmp, final)
            else:  # replacing the file checked (export --force)
                os.replace(tmp, final)
        except FileExistsError:
            raise FolderChanged(changed_message(final, None)) from None
        fsync_dir(final.parent)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def write_file(path: Path, chunks: Iterable[bytes]) -> None:
    """Write a file atomically: into `.NAME.PID.tmp` beside it, fsynced, then renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: no `.NAME.PID.tmp` is left behind
        tmp.unlink(missing_ok=True)
        raise
