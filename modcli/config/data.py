"""DataConfig: where the training text comes from and how it is split and tokenised."""

from __future__ import annotations

from dataclasses import dataclass

from modcli.config.validation import require


@dataclass
class DataConfig:
    """Where training text comes from."""

    data: str | None = None
    """A text file, a folder of files, or a tokenised .bin; None = the built-in Python stdlib corpus."""
    glob: str = "**/*"
    """Pattern of the files to read when --data is a folder."""
    val_fraction: float = 0.02
    """Fraction held out for validation (by file for folders, the tail for a single file)."""
    tokenizer: str = "bytes"
    """bytes (token = byte), or a tokenizer.json, relative to the run folder (runs made by `modcli import`)."""

    def __post_init__(self) -> None:
        require(0.0 < self.val_fraction < 0.5, f"--val-fraction must be in (0, 0.5), got {self.val_fraction}")
