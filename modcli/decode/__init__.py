"""Decoding: generation, the static (compiled) decode step, the graphs it shares with export."""
