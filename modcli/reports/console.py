"""Where numbers go: metrics.jsonl (+ TensorBoard when installed), progress on stderr, tables on stdout."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from modcli.errors import UserError

stderr_console = Console(stderr=True)


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl and mirrors scalars to TensorBoard if available."""

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # Drop lines written after the checkpoint we resume from, so the log matches the resumed run (and a
            # last line cut short by a kill: read_metrics_file).
            records, _ = read_metrics_file(self.path)
            self.path.write_text("".join(json.dumps(record) + "\n" for record in records
                                         if record.get("step", 0) <= resume_step))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self.file = open(self.path, "a")
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resume_step)
        except ImportError:
            pass

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def read_metrics_file(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """metrics.jsonl's records in order, and a note to print, if any. A damaged last line (cut short: what a kill in
    the middle of a write leaves) is dropped and the note says so; a damaged line before it (not UTF-8, not a JSON
    object, a step that is no integer) was not written by a kill: a UserError naming the file and line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    numbered = [(number, line) for number, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    records: list[dict[str, Any]] = []
    for index, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            record = None
        step = record.get("step", 0) if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            records.append(record)
        elif index == len(numbered) - 1:
            return records, f"note: {path}: its last line, line {number}, was cut short (a kill in the middle of a " \
                             "write); dropped"
        else:
            raise UserError(f"{path}: line {number} is damaged (not a metrics record: a JSON object with an integer "
                            "step); repair or delete that line")
    return records, None


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class StepProgress:
    """A Rich progress bar on a terminal; plain lines every `log_every` steps otherwise."""

    def __init__(self, total: int, start: int, log_every: int, quiet: bool = False) -> None:
        self.total, self.log_every, self.quiet = total, log_every, quiet
        self.started = time.perf_counter()
        self.start_step = start
        self.bar = None
        if not quiet and sys.stderr.isatty():
            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=stderr_console)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif not self.quiet and (step % self.log_every == 0 or step == self.total):
            elapsed = time.perf_counter() - self.started
            rate = (step - self.start_step) / max(elapsed, 1e-9)
            eta = (self.total - step) / max(rate, 1e-9)
            print(f"step {step}/{self.total} {info} eta {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def key_value_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(key, value)
    return table


def print_json(payload: dict[str, Any]) -> None:
    """Exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"
