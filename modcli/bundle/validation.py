"""Validation of an exported bundle: every graph on every runner against eager PyTorch on the same checkpoint.

- Cases: the forward graph (top-k) on random tokens at the sequence lengths where k changes and on real text;
  the decode graph on text and random prompts, greedy for `--decode-steps` tokens.
- References: `eager_forward` (model(tokens, "topk"): logits and selected positions) and `eager_generation`
  (`modcli generate`'s prefill and decode_step at temperature 0: tokens, logits, processed counts and KV cache
  lengths per layer).
- Runners: onnxruntime through modcli_runtime on each provider (`validation_providers`), and with --compile the
  ExportedPrograms and AOTInductor packages.

A check that exceeds atol, selects other positions, generates other tokens or fails to run is a failed `Check`,
except where eager PyTorch's own routing scores sit within atol of the decision boundary where the runner chose
differently (a top-k tie at the k-th score; a causal logit within atol of 0): such a case is marked `ambiguous`
and not failed, since float rounding alone can flip it. Exact ties cannot flip: top-k breaks them by position,
lower first, in every runner (modcli.models.routing.select_topk). `validate_bundle` returns every check and the caller
decides what the bundle's `valid` is.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from modcli_runtime.bundle import Bundle, session_providers
from modcli_runtime.cache import CacheSpec
from modcli_runtime.errors import BundleError
from modcli_runtime.generate import generate_tokens

from modcli.bundle.config import ExportConfig
from modcli.bundle.lowering import MIN_OPSET, GraphSpec
from modcli.config import ModelConfig
from modcli.decode.generation import prefill
from modcli.decode.graphs import selected_positions
from modcli.decode.greedy import greedy_decode
from modcli.errors import UserError
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder


@dataclass
class Check:
    """One validation case of one graph on one runner, against eager PyTorch."""

    graph: str
    runner: str
    case: str
    max_abs_diff: float
    indices_match: bool | None
    """forward: every routed block selected the same positions; decode: the same processed counts and KV cache
    lengths per layer."""
    tokens_match: bool | None
    """decode only: greedy tokens equal to `modcli generate`'s."""
    passed: bool
    detail: str = ""
    ambiguous: bool = False
    """The runner chose differently only where eager PyTorch's routing scores sit within atol of the decision
    boundary (a top-k tie at the k-th score, or a causal logit within atol of 0): float rounding may flip such a
    choice, so the case is reported as ambiguous and not counted as a failure."""


# ----------------------------------------------------------------------------------------------- cases


def validation_lengths(config: ModelConfig) -> list[int]:
    """Sequence lengths around the points where k = max(1, T * num // den) changes, plus the training length."""
    num, den = config.capacity_fraction()
    step = max(1, -(-den // num))  # T where k first reaches 1 without the max
    lengths = {1, 2, 3, step - 1, step, step + 1, 2 * step - 1, 2 * step, 2 * step + 1, config.seq_len}
    longest = max(config.seq_len, min(2 * step + 1, 4 * config.seq_len))  # a tiny capacity must not ask for huge T
    return sorted(t for t in lengths if 1 <= t <= longest)


def validation_text(path: str | None, vocab_size: int) -> np.ndarray:
    if path is None:
        raw = Path(textwrap.__file__).read_bytes()
    else:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"--text: no such file: {p}")
        raw = p.read_bytes()
        if len(raw) < 16:
            raise UserError(f"--text: {p} is too short ({len(raw)} bytes, need at least 16)")
    return np.frombuffer(raw, dtype=np.uint8).astype(np.int64) % vocab_size


def _text_windows(text: np.ndarray, batch: int, length: int) -> torch.Tensor:
    reps = -(-(batch * length + 1) // len(text))
    tiled = np.tile(text, reps)
    starts = [(i * 997) % max(1, len(tiled) - length) for i in range(batch)]
    return torch.from_numpy(np.stack([tiled[s:s + length] for s in starts]))


def forward_cases(config: ModelConfig, text: np.ndarray, seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for length in validation_lengths(config):
        tokens = torch.randint(0, config.vocab_size, (2, length), generator=generator)
        cases.append((f"random B=2 T={length}", tokens))
    top = max(validation_lengths(config))
    cases.append((f"random B=1 T={top}", torch.randint(0, config.vocab_size, (1, top), generator=generator)))
    cases.append((f"text B=3 T={config.seq_len}", _text_windows(text, 3, config.seq_len)))
    odd = max(3, config.seq_len // 2 + 1)
    cases.append((f"text B=2 T={odd}", _text_windows(text, 2, odd)))
    return cases


def decode_cases(config: ModelConfig, text: np.ndarray, seed: int) -> list[tuple[str, list[list[int]]]]:
    rng = np.random.default_rng(seed)
    windows = _text_windows(text, 3, 24).tolist()
    return [
        ("text B=1 prompt 17", [windows[0][:17]]),
        ("text B=2 prompts 21,9", [windows[1][:21], windows[2][:9]]),
        ("random B=3 prompts 4,11,7", [rng.integers(0, config.vocab_size, n).tolist() for n in (4, 11, 7)]),
        ("text+random B=2 prompts 12,12", [windows[0][:12], rng.integers(0, config.vocab_size, 12).tolist()]),
    ]


# ----------------------------------------------------------------------------------------------- eager references


@torch.no_grad()
def eager_forward(model: MoDDecoder, tokens: torch.Tensor) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Logits (B, T, V), each routed block's selected positions (B, k; -1 in padding slots) and router logits
    (B, T), in the router's static mode (what the forward graph runs)."""
    mode = model.capabilities.static_mode if model.capabilities is not None else None
    logits, aux = model(tokens, mode, return_aux=True)
    records = aux.records
    return (logits.float().numpy(), [selected_positions(r.selection).numpy() for r in records],
            [r.router_logits.float().numpy() for r in records])


def topk_choice_is_ambiguous(scores: np.ndarray, reference: np.ndarray, got: np.ndarray, atol: float) -> bool:
    """True when the runner's top-k choice `got` (B, k) differs from the eager `reference` (B, k) only in
    tokens whose eager score (B, T) is within `atol` of the k-th largest score of its row (a tie or a near tie)."""
    if got.shape != reference.shape:
        return False
    k = reference.shape[1]
    for row in range(reference.shape[0]):
        swapped = np.setxor1d(reference[row], got[row])
        if swapped.size == 0:
            continue
        if swapped.min() < 0 or swapped.max() >= scores.shape[1]:
            return False
        kth = np.sort(scores[row])[::-1][k - 1]
        if np.abs(scores[row, swapped] - kth).max() > atol:
            return False
    return True


@dataclass
class EagerGeneration:
    """`modcli generate`'s PyTorch path at temperature 0 on a batch of prompts (what the decode graph must match)."""

    tokens: list[list[int]]
    """Greedy tokens per row."""
    logits: list[np.ndarray]
    """Per row, the (steps, V) logits each token was chosen from."""
    processed: dict[int, list[int]]
    """Per layer whose cache holds only what it processed (`kv_is_routed`), per row: those tokens."""
    cache_lengths: dict[int, list[int]]
    """Per layer, per row: tokens its KV cache holds at the end (prompt + steps - 1 in layers that store every row)."""
    margin: float
    """The smallest |logit| of the causal rule seen (how close any routing decision came to flipping)."""


@torch.no_grad()
def eager_generation(model: MoDDecoder, prompts: list[list[int]], steps: int, routing: str) -> EagerGeneration:
    """`modcli generate`'s PyTorch path at temperature 0: its prefill, then `decode_step` with the KV cache."""
    device = torch.device("cpu")
    dtype = model.embed.weight.dtype
    cache = DecoderCache.allocate(model.config, len(prompts), max(map(len, prompts)) + steps, device, dtype)
    with decision_margin(model, routing) as margin:
        logits = prefill(model, prompts, cache, routing, device, "float32")  # (B, V); the model is in the export dtype
        tokens, kept = _greedy_steps(model, cache, logits, len(prompts), steps, routing)
    lengths = {layer: cache.layers[layer].lengths.tolist() for layer in range(model.config.n_layers)}
    # A routed layer's cache counts what it processed, unless it caches every token (--route-part mlp,
    # --keep-skipped-kv).
    processed = {layer: lengths[layer] for layer in model.config.routed_layers()
                 if model.config.kv_is_routed(layer)}
    return EagerGeneration(tokens, [np.stack(rows) for rows in kept], processed, lengths, margin["closest"])


def _greedy_steps(model: MoDDecoder, cache, logits: torch.Tensor, batch: int, steps: int, routing: str):
    """`modcli generate`'s decoding loop at temperature 0 (modcli.decode.greedy), keeping each step's logits."""
    tokens: list[list[int]] = [[] for _ in range(batch)]
    kept: list[list[np.ndarray]] = [[] for _ in range(batch)]

    def emit(index: int, chosen: torch.Tensor, logits: torch.Tensor) -> None:
        for row in range(batch):
            tokens[row].append(int(chosen[row]))
            kept[row].append(logits[row].float().numpy())

    greedy_decode(logits, steps, lambda chosen: model.decode_step(chosen, cache, routing).float(), emit)
    return tokens, kept


@contextlib.contextmanager
def decision_margin(model: MoDDecoder, routing: str):
    """Tracks how close any causal routing decision came to flipping while the context is open: the smallest
    `Router.boundary_distance` over every decision of every routed block, `margin["closest"]` (inf for exact
    rules, or when no routed block ran)."""
    margin = {"closest": float("inf")}
    routers = [block.router for block in model.blocks if block.router is not None]
    for router in routers:
        def recording(x, logits, mode, positions, capacity, predictor_logits=None, router=router,
                      decide=router.decide):
            distance = router.boundary_distance(x, logits, mode, positions, capacity, predictor_logits)
            if distance.numel():
                margin["closest"] = min(margin["closest"], float(distance.min()))
            return decide(x, logits, mode, positions, capacity, predictor_logits)

        router.decide = recording  # an instance attribute: shadows the method until removed below
    try:
        yield margin
    finally:
        for router in routers:
            del router.decide


# ----------------------------------------------------------------------------------------------- runners and comparisons


def validate_bundle(folder: Path, model: MoDDecoder, specs: list[GraphSpec], config: ExportConfig,
                    providers: list[str], aoti: bool, text: np.ndarray) -> list[Check]:
    """Every graph written to `folder` against eager PyTorch: on onnxruntime for each of `providers`, and with
    --compile as ExportedProgram and (when `aoti`) AOTInductor package."""
    model_config = model.config
    dtype = model.embed.weight.dtype
    graphs = [spec.name for spec in specs]
    checks: list[Check] = []
    fwd_cases = forward_cases(model_config, text, config.seed)
    dec_cases = decode_cases(model_config, text, config.seed)
    steps, atol = config.decode_steps, float(config.atol)
    for provider in providers:
        try:
            bundle = Bundle(folder, provider=provider, verify=False, allow_invalid=True)
            name = f"ort-{bundle.active_provider.removesuffix('ExecutionProvider').lower()}"
        except BundleError as exc:
            raise UserError(f"--dtype {config.dtype} with --provider {provider}: {exc}") from None

        def run_forward(tokens: np.ndarray, bundle=bundle) -> list[np.ndarray]:
            logits, selected = bundle.forward(tokens)
            return [logits, *selected]

        if "forward" in graphs:
            checks += _check_forward(model, name, run_forward, fwd_cases, atol)
        if "decode" in graphs:
            step, cache = bundle.decoder()  # what `generate` runs on this provider (CUDA: the device cache)
            checks += _check_decode(model, name, step, cache, dec_cases, steps, config.routing, atol)
    if config.compile:
        runners: list[tuple[str, dict[str, Callable]]] = []
        loaded = {s.name: torch.export.load(str(folder / f"{s.name}.pt2")).module() for s in specs}
        runners.append(("pt2", loaded))
        if aoti:
            from torch._inductor import aoti_load_package  # seconds to import; only --compile needs it

            runners.append(("aoti-cpu", {s.name: aoti_load_package(str(folder / f"{s.name}.aoti.pt2")) for s in specs}))
        torch_spec = CacheSpec(model_config.n_layers, model_config.kv_heads, model_config.head_dim, "float32",
                               model_config.routed_layers(), model_config.capacity_fraction(),
                               [layer for layer in range(model_config.n_layers)
                                if model_config.kv_is_routed(layer)], model_config.kv_layers(),
                               [layer for layer in model_config.kv_layers() if model_config.is_sliding(layer)])
        by_name = {s.name: s for s in specs}
        for name, calls in runners:
            if "forward" in calls:
                forward_run = _torch_runner(calls["forward"], dtype)
                checks += _check_forward(model, name, lambda tokens, run=forward_run: run([tokens]), fwd_cases, atol)
            if "decode" in calls:
                decode_run = _torch_runner(calls["decode"], dtype)

                def step(feeds: dict[str, np.ndarray], run=decode_run) -> dict[str, np.ndarray]:
                    outputs = run([feeds[n] for n in by_name["decode"].input_names])
                    return dict(zip(by_name["decode"].output_names, outputs, strict=True))

                checks += _check_decode(model, name, step, torch_spec, dec_cases, steps, config.routing, atol)
    return checks


def _torch_runner(call: Callable, dtype: torch.dtype) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """numpy in, numpy out around a torch callable (AOTInductor package, ExportedProgram module)."""

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        tensors = [t.to(dtype) if t.is_floating_point() else t for t in tensors]
        with torch.no_grad():
            outputs = call(*tensors)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return [o.float().numpy() if o.is_floating_point() else o.numpy() for o in outputs]

    return run


def _check_forward(model: MoDDecoder, runner_name: str, run: Callable[[np.ndarray], list[np.ndarray]],
                   cases: list[tuple[str, torch.Tensor]], atol: float) -> list[Check]:
    checks = []
    for case, tokens in cases:
        ref_logits, ref_selected, ref_scores = eager_forward(model, tokens)
        try:
            outputs = run(tokens.numpy())
        except Exception as exc:  # a runtime failure on one shape is a failed check, not a crash
            checks.append(Check("forward", runner_name, case, float("inf"), None, None, False, f"failed to run: {exc}"))
            continue
        diff = float(np.abs(outputs[0].astype(np.float32) - ref_logits).max())
        same = all(o.shape == r.shape and bool((o == r).all()) for o, r in zip(outputs[1:], ref_selected, strict=True))
        passed, ambiguous, detail = diff <= atol and same, False, ""
        if not same:
            # Blocks before the first that differs chose alike; that block's choice may differ only at a tie.
            first = next(i for i, (o, r) in enumerate(zip(outputs[1:], ref_selected, strict=True))
                         if o.shape != r.shape or not (o == r).all())
            ambiguous = topk_choice_is_ambiguous(ref_scores[first], ref_selected[first], outputs[1 + first], atol)
            layer = model.config.routed_layers()[first]
            detail = (f"ambiguous: block {layer} chose differently only among tokens whose router logits are within "
                      f"atol of the k-th score (a tie); logits after it are not comparable" if ambiguous
                      else f"selected positions differ from eager top-k (first in block {layer})")
            passed = ambiguous
        checks.append(Check("forward", runner_name, case, diff, same if ref_selected else None, None, passed, detail,
                            ambiguous))
    return checks


def _check_decode(model: MoDDecoder, runner_name: str, step, cache_spec, cases: list[tuple[str, list[list[int]]]],
                  steps: int, routing: str, atol: float) -> list[Check]:
    checks = []
    for case, prompts in cases:
        reference = eager_generation(model, prompts, steps, routing)
        ref_tokens, ref_logits, ref_processed, margin = (reference.tokens, reference.logits, reference.processed,
                                                         reference.margin)
        try:
            got = generate_tokens(step, cache_spec, prompts, vocab_size=model.config.vocab_size,
                                  max_new_tokens=steps, temperature=0, return_logits=True)
        except Exception as exc:
            checks.append(Check("decode", runner_name, case, float("inf"), None, None, False, f"failed to run: {exc}"))
            continue
        diffs, details = [], []
        for row, (mine, ref) in enumerate(zip(got.logits, ref_logits, strict=True)):
            agree = next((i for i, (a, b) in enumerate(zip(got.tokens[row], ref_tokens[row], strict=True)) if a != b),
                         steps)
            diffs.append(float(np.abs(mine[:agree + 1] - ref[:agree + 1]).max()) if agree < steps
                         else float(np.abs(mine - ref).max()))
            if agree < steps:
                details.append(f"row {row}: greedy tokens differ from step {agree}")
        tokens_same = got.tokens == ref_tokens
        processed_same = {layer: got.processed_tokens[layer] for layer in ref_processed} == ref_processed
        if not processed_same:
            details.append(f"processed tokens per layer {got.processed_tokens} != eager {ref_processed}")
        lengths_same = got.cache_lengths == reference.cache_lengths
        if not lengths_same:
            details.append(f"KV cache lengths per layer {got.cache_lengths} != eager {reference.cache_lengths}")
        processed_same = processed_same and lengths_same
        diff = max(diffs)
        passed = diff <= atol and tokens_same and processed_same
        ambiguous = not passed and not (tokens_same and processed_same) and margin <= atol
        if ambiguous:
            details.insert(0, f"ambiguous: an eager {routing} logit came within {margin:.1e} of the threshold 0, so "
                              "float rounding may flip that token's routing")
        checks.append(Check("decode", runner_name, f"{case} +{steps}", diff,
                            processed_same if ref_processed else None, tokens_same,
                            passed or ambiguous, "; ".join(details), ambiguous))
    return checks


# ----------------------------------------------------------------------------------------------- onnxruntime providers


def validation_providers(provider: str) -> list[str]:
    """--provider -> the runtime providers to validate on; an unusable explicit one is a UserError."""
    try:
        session_providers(provider)
    except BundleError as exc:
        raise UserError(str(exc)) from None
    if provider == "cpu":
        return ["cpu"]
    cuda = cuda_provider_works()
    if provider == "cuda" and not cuda:
        raise UserError("--provider cuda: onnxruntime's CUDAExecutionProvider cannot start on this machine "
                        "(no GPU or missing CUDA/cuDNN libraries); use --provider cpu")
    return ["cpu", "cuda"] if cuda and provider == "auto" else (["cuda"] if cuda else ["cpu"])


def cuda_provider_works() -> bool:
    """Start the CUDA provider on a one-node model: onnxruntime-gpu lists it even where it cannot load."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    value = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [value("x", TensorProto.FLOAT, [1])], [value("y", TensorProto.FLOAT, [1])])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", MIN_OPSET)], ir_version=8)
    onnx.checker.check_model(probe)
    ort.set_default_logger_severity(4)  # the failed library load is reported as one line by our caller instead
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(probe.SerializeToString(), sess_options=options,
                                       providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        return "CUDAExecutionProvider" in session.get_providers()
    except Exception:
        return False
    finally:
        ort.set_default_logger_severity(2)
