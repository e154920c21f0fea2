"""`modcli profile`: FLOPs, latency and memory of an MoD model against its dense twin, per backend.

By concern: `profile` (the API, `profile(ProfileConfig) -> ProfileResult`), `config` (the config and result types),
`subjects` (the model, its baseline, router calibration), `calls` (what is timed on PyTorch, eager and compiled),
`onnx` (the onnxruntime backend), `flop_counts` (counted FLOPs), `measure` (every measurement at one sequence
length), `memory` (peak memory in child processes) and `report` (ratios, tables, plot). The timing harness and its
statistics are `modcli_runtime.timing`, which the PyTorch-free runtime's `time_bundle` (`--onnx`) uses too.
"""
