"""Publishing files and folders atomically: checkpoints (modcli.checkpoint.store), export bundles
(modcli.bundle.writer) and corpus caches (modcli.data.corpus).

A folder is written under a temporary name next to its final place (`.tmp-NAME-PID`); every file and the folder
are fsynced, an optional completion marker (the sha256 and size of every file) is written last, and one
`os.replace` puts the folder in place. A folder already there is moved aside first (`.old-NAME-PID`) and deleted
once the new one is in place. On any failure the temporary folder is removed and a displaced folder is put back, so
the final path holds the old folder or the new one, never a part of either. A folder is deleted by renaming it to
`.trash-NAME-PID` first, so a kill midway leaves nothing half-deleted under its name. What a killed writer left is
tidied by `clean_stale`, called while holding the writer's lock (modcli.checkpoint.lock).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from modcli_runtime.bundle import sha256_of


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


@contextmanager
def publish_folder(final: Path, marker: str | None = None, pause: Callable[[], None] = _no_pause) -> Iterator[Path]:
    """`with publish_folder(final) as tmp:` fill the empty folder `tmp`; when the block ends, it replaces `final`.

    `marker`: the name of a completion file written last, holding {"complete": true, "files": {name: {"sha256",
    "bytes"}}} for every other file. `pause` is called between the steps (a test hook that lets a test kill the
    writer at each moment). An exception in the block or while publishing removes `tmp`, puts a displaced `final`
    back, and propagates.
    """
    tmp, old = temporary_path(final, "tmp"), temporary_path(final, "old")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        pause()
        tmp.mkdir()
        yield tmp
        files = {}
        for child in sorted(tmp.iterdir()):
            fsync_file(child)
            if marker is not None:
                files[child.name] = {"sha256": sha256_of(child), "bytes": child.stat().st_size}
        if marker is not None:
            pause()
            (tmp / marker).write_text(json.dumps({"complete": True, "files": files}, indent=2) + "\n")
            fsync_file(tmp / marker)
        fsync_dir(tmp)
        pause()
        if final.exists():  # replaced: swap, then remove the old folder
            os.replace(final, old)
            pause()
            os.replace(tmp, final)
            fsync_dir(final.parent)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
            fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise


def remove_folder(folder: Path, pause: Callable[[], None] = _no_pause) -> None:
    """Delete `folder`: renamed to `.trash-` first, so a kill while deleting leaves no half-deleted folder under its
    name (clean_stale removes the rest)."""
    trash = temporary_path(folder, "trash")
    os.replace(folder, trash)
    pause()
    shutil.rmtree(trash)


def clean_stale(parent: Path, name: str, marker: str, removed: dict[str, str], restored: str) -> list[str]:
    """Tidy what interrupted writers left in `parent`; returns one note per folder handled.

    Call only while holding the writer's lock (nothing is being written). `name`: a regex of the final folders'
    names; a displaced folder (`.old-`) holding `marker` whose final folder is missing is put back (`restored` says
    what left it), and every other temporary folder of the kinds in `removed` (kind -> what left it) is deleted.
    """
    notes: list[str] = []
    if not parent.is_dir():
        return notes
    pattern = re.compile(rf"^\.(?P<kind>{'|'.join(removed)})-(?P<final>{name})-\d+$")
    for path in sorted(parent.iterdir()):
        match = pattern.match(path.name)
        if match is None or not path.is_dir():
            continue
        kind, final = match["kind"], parent / match["final"]
        if kind == "old" and (path / marker).is_file() and not final.exists():
            os.replace(path, final)
            notes.append(f"note: restored {final} from {path.name}, left by {restored}")
            continue
        shutil.rmtree(path, ignore_errors=True)
        notes.append(f"note: removed the stale temporary folder {path} ({removed[kind]})")
    return notes


def write_file(path: Path, chunks: Iterable[bytes]) -> None:
    """Write a file atomically: into `.NAME.PID.tmp` beside it, fsynced, then renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
