"""A MoDDecoder -> exportable graphs: what each graph takes and returns, torch.export, ONNX and AOTInductor.

`forward_spec` and `decode_spec` wrap the model in modcli.decode.graphs' ForwardGraph and DecodeStepGraph and
give each graph its sample inputs, dynamic dims and readable input/output names. `export_program` runs
torch.export on a spec; `export_onnx` turns the ExportedProgram into an ONNX file (dynamo exporter) and
`compile_aoti` into an AOTInductor package; `onnx_summary` reads back an ONNX file's op histogram and signature.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import platform
import shutil
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

from modcli.bundle.attention import translation_table
from modcli.bundle.onnx_walk import all_nodes
from modcli.decode.graphs import DecodeStepGraph, ForwardGraph
from modcli.models.decoder import MoDDecoder

MIN_OPSET = 18
"""The dynamo exporter's translation library targets opset 18 and later (opset 18 is also what we validate)."""
FORWARD_NOTE = ("{mode} routing: {rule}; a fixed number of tokens per T (non-causal: whether a token is processed "
                "depends on later tokens); for scoring whole sequences, not for decoding")
DECODE_NOTE = ("causal routing ({routing}: {rule}), one token per sequence against a read-only KV cache: the graph "
               "returns only this step's K/V per layer (new_keys/new_values, slot dim 1) and the caller stores them "
               "(see the cache entry); routed blocks run inside an If: skipped entirely, reading no cache, when no "
               "row of the batch processes the token (a real skip for batch 1), otherwise computed for every row "
               "with skipped rows left bit for bit unchanged and their K/V not stored")


@dataclass
class GraphSpec:
    """A graph to export: its wrapper module, sample inputs, dynamic dims, names and readable axis names."""

    name: str
    module: torch.nn.Module
    args: tuple
    dynamic_shapes: tuple
    input_names: list[str]
    output_names: list[str]
    input_axes: dict[str, dict[int, str]]
    """Readable names of each input's dynamic axes (the ONNX file uses them)."""
    output_axes: dict[str, dict[int, str]]
    """Readable names of dynamic output axes that are not an input's axis (e.g. the top-k capacity)."""
    routing: str
    causal: bool
    note: str


def forward_spec(model: MoDDecoder) -> GraphSpec:
    config = model.config
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=generator)  # (B, T) odd T: no coincidences
    routed = config.routed_layers()
    outputs = ["logits", *[f"selected.{layer}" for layer in routed]]
    return GraphSpec(
        name="forward", module=ForwardGraph(model).eval(), args=(tokens,),
        dynamic_shapes=({0: Dim("batch", min=1), 1: Dim("seq", min=1)},),
        input_names=["tokens"], output_names=outputs, input_axes={"tokens": {0: "batch", 1: "seq"}},
        output_axes={f"selected.{layer}": {1: "capacity"} for layer in routed},
        routing=_static_mode(model), causal=not routed,
        note=FORWARD_NOTE.format(mode=_static_mode(model), rule=_rule(model, _static_mode(model))) if routed
        else "dense model")


def decode_spec(model: MoDDecoder, routing: str) -> GraphSpec:
    config = model.config
    dtype = model.embed.weight.dtype
    generator = torch.Generator().manual_seed(0)
    batch = Dim("batch", min=1)
    tokens = torch.randint(0, config.vocab_size, (2,), generator=generator)  # (B,)
    positions = torch.tensor([9, 12])  # (B,)
    module = DecodeStepGraph(model, routing, export_row_cap=True).eval()
    cache: list[torch.Tensor] = []
    cache_shapes: list[dict[int, Any]] = []
    axes: dict[str, dict[int, str]] = {"tokens": {0: "batch"}, "positions": {0: "batch"}}
    for layer in config.kv_layers():  # --drop: a layer without attention has no cache
        slots = 13 + 2 * layer  # distinct sample sizes: each layer's slot count is its own dimension
        shape = (2, config.kv_heads, slots, config.head_dim)
        cache += [torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype),
                  torch.tensor([4, 7])]
        slot_dim = Dim(f"slots_{layer}", min=1)
        cache_shapes += [{0: batch, 2: slot_dim}, {0: batch, 2: slot_dim}, {0: batch}]
        axes.update({f"keys.{layer}": {0: "batch", 2: f"slots.{layer}"},
                     f"values.{layer}": {0: "batch", 2: f"slots.{layer}"}, f"lengths.{layer}": {0: "batch"}})
        if layer in module.local_layers:  # --sliding-window: each slot's original position, ascending
            cache.append(torch.arange(slots).repeat(2, 1))  # (B, slots)
            cache_shapes.append({0: batch, 1: slot_dim})
            axes[f"slot_positions.{layer}"] = {0: "batch", 1: f"slots.{layer}"}
    mode = routing if not config.dense else "dense"
    return GraphSpec(
        name="decode", module=module, args=(tokens, positions, *cache),
        dynamic_shapes=({0: batch}, {0: batch}, tuple(cache_shapes)), input_names=module.input_names,
        output_names=module.output_names,
        input_axes=axes, output_axes={}, routing=mode, causal=True,
        note=DECODE_NOTE.format(routing=routing, rule=_rule(model, routing)) if not config.dense
        else "dense model, one token per sequence")


def _static_mode(model: MoDDecoder) -> str:
    return model.capabilities.static_mode if model.capabilities is not None else "dense"


def _rule(model: MoDDecoder, mode: str) -> str:
    """The router's own description of a mode (e.g. "router logit > 0 ...")."""
    return f"{model.config.router} router, " + model.capabilities.notes.get(mode, mode)


@contextlib.contextmanager
def _quiet_exporter():
    """The exporters log optional-dependency notes and deprecation warnings; results go to the manifest instead."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._inductor", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def export_program(spec: GraphSpec) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with dynamic dims; a failure says which graph and keeps its traceback."""
    try:
        with _quiet_exporter():
            return torch.export.export(spec.module, spec.args, dynamic_shapes=spec.dynamic_shapes, strict=False)
    except Exception as exc:
        raise RuntimeError(f"torch.export of the {spec.name} graph failed (no fallback is tried): {exc}") from exc


def export_onnx(spec: GraphSpec, program: torch.export.ExportedProgram, path: Path, opset: int) -> None:
    """torch.onnx.export(dynamo=True) of an ExportedProgram, dynamic axes renamed to readable names."""
    try:
        with _quiet_exporter():
            onnx_program = torch.onnx.export(copy.deepcopy(program), spec.args, dynamo=True, opset_version=opset,
                                             input_names=spec.input_names, output_names=spec.output_names,
                                             verbose=False, optimize=True,
                                             custom_translation_table=translation_table())
    except Exception as exc:
        raise RuntimeError(f"ONNX export of the {spec.name} graph failed (opset {opset}; no fallback to the "
                           f"TorchScript exporter is tried): {exc}") from exc
    graph = onnx_program.model.graph
    renames: dict[Any, str] = {}
    for values, axes in ((graph.inputs, spec.input_axes), (graph.outputs, spec.output_axes)):
        for value in values:
            for axis, readable in axes.get(value.name, {}).items():
                dim = value.shape[axis]
                if isinstance(getattr(dim, "value", None), str):
                    renames[dim] = readable
    onnx_program.rename_axes(renames)
    onnx_program.save(str(path))


CACHE_WRITE_NOTE = ("writes one decode step's K/V rows into a cache buffer: cache_out = cache with "
                    "cache_out[indices[i, h]] = new_rows[rows[i], h, 0] (indices (n, Hkv, 3) = row, head, slot); "
                    "modcli_runtime binds cache_out to the cache's own device buffer, so ScatterND writes in place "
                    "(the CUDA provider's device-resident KV cache)")


def write_cache_writer(path: Path, dtype: str, opset: int) -> None:
    """cache_write.onnx: Gather the writing rows of a (B, Hkv, 1, hd) new-K/V output, ScatterND them into a
    (B, Hkv, S, hd) cache at [row, head, slot]. Built directly with onnx.helper (three nodes, no weights)."""
    import onnx
    from onnx import TensorProto, helper

    element = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    value = helper.make_tensor_value_info
    nodes = [helper.make_node("Gather", ["new_rows", "rows"], ["picked"], axis=0),  # (n, Hkv, 1, hd)
             helper.make_node("Squeeze", ["picked", "slot_axis"], ["updates"]),  # (n, Hkv, hd)
             helper.make_node("ScatterND", ["cache", "indices", "updates"], ["cache_out"])]
    graph = helper.make_graph(
        nodes, "cache_write",
        [value("cache", element, ["batch", "heads", "slots", "head_dim"]),
         value("new_rows", element, ["batch", "heads", 1, "head_dim"]),
         value("rows", TensorProto.INT64, ["rows"]), value("indices", TensorProto.INT64, ["rows", "heads", 3])],
        [value("cache_out", element, ["batch", "heads", "slots", "head_dim"])],
        initializer=[helper.make_tensor("slot_axis", TensorProto.INT64, [1], [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8,
                              producer_name="modcli")
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


def onnx_summary(path: Path) -> tuple[dict[str, int], list[dict[str, Any]], list[dict[str, Any]]]:
    """(op histogram including If branches, inputs, outputs) of an ONNX file."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    histogram = Counter(node.op_type for node in all_nodes(model.graph))

    def describe(value) -> dict[str, Any]:
        tensor = value.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        return {"name": value.name, "shape": shape, "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name}

    return (dict(histogram.most_common()), [describe(v) for v in model.graph.input],
            [describe(v) for v in model.graph.output])


def aoti_supported() -> tuple[bool, str]:
    """AOTInductor on CPU needs a C++ compiler; says why not when it cannot run."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None and shutil.which("clang++") is None:
        return False, f"no C++ compiler ({compiler} or clang++) on PATH"
    if platform.system() not in ("Linux", "Darwin"):
        return False, f"AOTInductor packages are not supported on {platform.system()} here"
    return True, ""


def compile_aoti(spec: GraphSpec, program: torch.export.ExportedProgram, path: Path) -> float:
    """AOTInductor package of an ExportedProgram for this machine's CPU at `path`; returns the compile seconds."""
    from torch._inductor import aoti_compile_and_package  # seconds to import; only --compile needs it

    start = time.perf_counter()
    try:
        with _quiet_exporter():
            aoti_compile_and_package(program, package_path=str(path))
    except Exception as exc:
        raise RuntimeError(f"AOTInductor compile of the {spec.name} graph failed: {exc} "
                           "(export without --compile for an ONNX-only bundle)") from exc
    return time.perf_counter() - start
