"""Checkpoints on disk: atomic step folders (and the atomic publish that bundles share), loading with checks, the run
lock."""
