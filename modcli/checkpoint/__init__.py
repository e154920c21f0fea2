"""Checkpoints on disk: atomic step folders, loading with checks, the run lock."""
