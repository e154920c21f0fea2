"""`modcli routes`: which tokens each routed block processed for one text, in every routing mode of the router.

The text is tokenized with the run's tokenizer (bytes or its tokenizer.json) and routed in windows of the model's
seq_len, as training and `modcli eval` see text. For each window and each routing mode the model runs once; each
routed block reports the tokens it processed (its RoutingRecord's selection) and, for a causal mode, the
probability behind the decision: sigmoid of the signed distance of the rule's score from its boundary
(`Router.boundary_distance`, positive when the token is processed). For the topk router's `router` rule that is
sigmoid(router logit), for a predictor sigmoid(predictor logit), for the threshold router sigmoid(logit - logit(p))
(0.5 at the threshold); a rule with no score (the random router's position hash) gives 0 or 1. Where a causal rule
and the router's full-sequence mode (top-k) chose differently is marked per token.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from modcli.checkpoint.store import load_model_from
from modcli.config import require
from modcli.data.tokenizer import load_tokenizer
from modcli.errors import UserError
from modcli.hardware import resolve_device


@dataclass
class RouteConfig:
    """What `modcli routes` routes."""

    checkpoint: str
    """A run folder (its newest checkpoint) or a checkpoint folder."""
    text: str
    """A UTF-8 text file."""
    max_tokens: int | None = None
    """Route only the first N tokens; None = all of them."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""

    def __post_init__(self) -> None:
        require(self.max_tokens is None or self.max_tokens >= 1, f"--max-tokens must be >= 1, got {self.max_tokens}")


@dataclass
class BlockRoutes:
    """One routed block's decisions over the whole text."""

    layer: int
    processed: dict[str, list[bool]]
    """Per routing mode: whether each token was processed."""
    probability: dict[str, list[float]]
    """Per causal mode: the probability behind each token's decision (see the module docstring)."""
    disagreement: dict[str, list[bool]]
    """Per causal mode: where it chose differently from the full-sequence reference mode (empty without one)."""
    processed_fraction: dict[str, float]
    disagreement_fraction: dict[str, float]


@dataclass
class RouteMap:
    checkpoint: str
    router: str
    tokenizer: str
    seq_len: int
    """Window length: the text is routed in windows of the model's seq_len."""
    tokens: list[int]
    pieces: list[str]
    """The text of each token; joined they give the routed text back."""
    modes: list[str]
    """The router's routing modes, its training mode first."""
    causal: dict[str, bool]
    causal_modes: list[str]
    reference_mode: str | None
    """The full-sequence (non-causal) mode causal rules are compared with, e.g. topk."""
    blocks: list[BlockRoutes]


def token_pieces(tokenizer, text: str, ids: list[int]) -> list[str]:
    """The text of each token, such that "".join(pieces) == text.

    Bytes: a character's text goes to its first byte, the continuation bytes of a multi-byte character get "". A
    tokenizer.json: character offsets from the tokenizer; text between tokens goes to the next token."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None:  # bytes
        pieces, data, i = [], text.encode("utf-8"), 0
        while i < len(data):
            width = next((w for w in (1, 2, 3, 4) if _decodes(data[i:i + w])), 1)
            pieces.append(data[i:i + width].decode("utf-8", errors="replace"))
            pieces.extend([""] * (width - 1))
            i += width
        return pieces
    offsets = inner.encode(text).offsets
    if len(offsets) != len(ids):
        raise UserError("the tokenizer's offsets do not match its tokens (special tokens added?)")
    pieces, covered = [], 0
    for _, end in offsets:
        end = max(end, covered)
        pieces.append(text[covered:end])
        covered = end
    if pieces:
        pieces[-1] += text[covered:]
    return pieces


def _decodes(chunk: bytes) -> bool:
    try:
        chunk.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@torch.no_grad()
def route_map(config: RouteConfig) -> RouteMap:
    """Route the text through the run's model in every mode of its router (see the module docstring)."""

    path = Path(config.text)
    if not path.is_file():
        raise UserError(f"--text: no such file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--text: {path} is not UTF-8 text ({exc})") from None
    device = resolve_device(config.device)
    model, run_config, checkpoint = load_model_from(config.checkpoint, device)
    if model.config.dense:
        raise UserError(f"{checkpoint} is a dense model: no block is routed")
    tokenizer = load_tokenizer(run_config.data.tokenizer, checkpoint.parent)
    ids = tokenizer.encode(text)
    pieces = token_pieces(tokenizer, text, ids)
    if config.max_tokens is not None and len(ids) > config.max_tokens:
        ids, pieces = ids[:config.max_tokens], pieces[:config.max_tokens]
    if not ids:
        raise UserError(f"--text: {path} holds no tokens")
    return route_tokens(model, ids, pieces, str(checkpoint), tokenizer.name)


@torch.no_grad()
def route_tokens(model, ids: list[int], pieces: list[str], checkpoint: str = "", tokenizer: str = "bytes") -> RouteMap:
    """The route map of token `ids` through `model` (an MoD decoder), in windows of its seq_len."""
    device = next(model.parameters()).device
    model.eval()
    caps = model.capabilities
    modes = list(model.routing_modes())
    causal_modes = [m for m in modes if caps.is_causal(m)]
    reference = next((m for m in modes if not caps.is_causal(m)), None)
    seq_len = model.config.seq_len
    layers = model.config.routed_layers()
    processed = {layer: {m: [] for m in modes} for layer in layers}
    probability = {layer: {m: [] for m in causal_modes} for layer in layers}
    inputs: dict[int, torch.Tensor] = {}
    hooks = [model.blocks[layer].register_forward_pre_hook(
        lambda module, args, layer=layer: inputs.__setitem__(layer, args[0])) for layer in layers]
    try:
        for start in range(0, len(ids), seq_len):
            window = torch.tensor([ids[start:start + seq_len]], device=device)  # (1, T)
            positions = torch.arange(window.shape[1], device=device)  # (T,)
            for mode in modes:
                _, aux = model(window, mode, return_aux=True)
                records = aux.records
                for record in records:
                    chosen = torch.zeros(window.shape[1], dtype=torch.bool, device=device)  # (T,)
                    idx = record.selection.selected_idx[0]  # (k,)
                    if record.selection.valid is not None:
                        idx = idx[record.selection.valid[0]]
                    chosen[idx] = True
                    processed[record.layer][mode].extend(chosen.tolist())
                    if mode in causal_modes:
                        distance = record.router.boundary_distance(
                            inputs[record.layer], record.router_logits, mode, positions, record.capacity,
                            record.predictor_logits)[0].float()  # (T,)
                        signed = torch.where(chosen, distance, -distance)
                        probability[record.layer][mode].extend(torch.sigmoid(signed).tolist())
    finally:
        for hook in hooks:
            hook.remove()
    blocks = []
    for layer in layers:
        disagreement = {}
        if reference is not None:
            disagreement = {m: [a != b for a, b in zip(processed[layer][m], processed[layer][reference], strict=True)]
                            for m in causal_modes}
        blocks.append(BlockRoutes(
            layer=layer, processed=processed[layer], probability=probability[layer], disagreement=disagreement,
            processed_fraction={m: sum(v) / len(v) for m, v in processed[layer].items()},
            disagreement_fraction={m: sum(v) / len(v) for m, v in disagreement.items()}))
    return RouteMap(checkpoint=checkpoint, router=model.config.router, tokenizer=tokenizer, seq_len=seq_len,
                    tokens=list(ids), pieces=list(pieces), modes=modes, causal={m: caps.is_causal(m) for m in modes},
                    causal_modes=causal_modes, reference_mode=reference, blocks=blocks)


# --- HTML -----------------------------------------------------------------------------------------------------------

COLOURS = ["#f4a261", "#2a9d8f", "#e76f51", "#8ab17d", "#b5838d"]

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
pre.text { white-space: pre-wrap; font: 13px/1.9 ui-monospace, Menlo, Consolas, monospace; background: #fafafa;
           border: 1px solid #ddd; padding: .6em; }
.t { border-bottom: 3px solid transparent; }
.t.nl::before { content: "\\21B5"; color: #bbb; }
.key span { padding: 0 .4em; margin-right: .6em; }
section.block h2 { font-size: 1.05em; margin: 1.2em 0 .3em; }
.stats { font-size: .85em; color: #555; margin: .2em 0; }
label { margin-right: 1em; }
"""


def _mode_css(modes: list[str], causal_modes: list[str], reference: str | None) -> str:
    rules = []
    for i, mode in enumerate(modes):
        colour = COLOURS[i % len(COLOURS)]
        rules.append(f'body[data-view="{mode}"] .t[data-{mode}="1"] {{ background: {colour}55; }}')
        if mode in causal_modes:
            rules.append(f'body[data-view="{mode}"] .t {{ border-bottom-color: rgb(40 80 200 / var(--p-{mode})); }}')
            if reference is not None:
                rules.append(f'body[data-view="{mode}"] .t[data-vs-{reference}-{mode}="1"] '
                             '{ outline: 1.5px solid #d00; outline-offset: -1px; }')
    return "\n".join(rules)


def render_html(result: RouteMap) -> str:
    """A self-contained page (inline CSS and a few lines of script, nothing fetched): per routed block the whole
    text, every token one <span>, coloured where the viewed mode processed it; a causal mode's probability
    underlines each token, and a red outline marks where it disagrees with the reference mode."""
    default = result.causal_modes[0] if result.causal_modes else result.modes[0]
    switches = " ".join(
        f'<label><input type="radio" name="view" value="{m}"{" checked" if m == default else ""} '
        f'onchange="document.body.dataset.view=this.value"> {html.escape(m)}'
        f'{"" if result.causal[m] else " (non-causal)"}</label>' for m in result.modes)
    sections = []
    for block in result.blocks:
        stats = "; ".join(f"{m}: {block.processed_fraction[m]:.1%} processed" for m in result.modes)
        if result.reference_mode:
            stats += "; " + "; ".join(f"{m} disagrees with {result.reference_mode} on "
                                      f"{block.disagreement_fraction[m]:.1%}" for m in result.causal_modes)
        spans = []
        for i, piece in enumerate(result.pieces):
            attrs = [f'data-i="{i}"']
            attrs += [f'data-{m}="{int(block.processed[m][i])}"' for m in result.modes]
            if result.reference_mode:
                attrs += [f'data-vs-{result.reference_mode}-{m}="{int(block.disagreement[m][i])}"'
                          for m in result.causal_modes]
            style = "; ".join(f"--p-{m}: {block.probability[m][i]:.3f}" for m in result.causal_modes)
            tip = f"token {i} ({result.tokens[i]}) {piece!r}: " + ", ".join(
                f"{m} {'yes' if block.processed[m][i] else 'no'}"
                + (f" p={block.probability[m][i]:.2f}" if m in block.probability else "") for m in result.modes)
            cls = "t nl" if piece.endswith("\n") else "t"
            spans.append(f'<span class="{cls}" {" ".join(attrs)} style="{style}" title="{html.escape(tip)}">'
                         f"{html.escape(piece)}</span>")
        sections.append(f'<section class="block" data-layer="{block.layer}"><h2>block {block.layer}</h2>'
                        f'<p class="stats">{html.escape(stats)}</p><pre class="text">{"".join(spans)}</pre></section>')
    legend = ("Background: processed by the block in the mode chosen above. Underline (causal modes): the probability "
              "behind the decision (darker = surer yes). ")
    if result.reference_mode:
        legend += f"Red outline: the causal mode and {result.reference_mode} chose differently. "
    legend += "Hover a token for every mode's decision."
    data = json.dumps({"modes": result.modes, "causal": result.causal, "reference": result.reference_mode})
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>routes: '
            f'{html.escape(result.checkpoint)}</title>\n<style>{STYLE}\n'
            f'{_mode_css(result.modes, result.causal_modes, result.reference_mode)}</style></head>\n'
            f'<body data-view="{default}" data-routes=\'{html.escape(data)}\'>\n'
            f'<h1 style="font-size:1.2em">{html.escape(result.checkpoint)}: {result.router} router, '
            f'{len(result.tokens)} tokens ({html.escape(result.tokenizer)}), windows of {result.seq_len}</h1>\n'
            f'<p>{switches}</p><p class="stats">{html.escape(legend)}</p>\n' + "\n".join(sections) + "\n</body></html>\n")


def write_html(result: RouteMap, path: str | Path) -> str:
    Path(path).write_text(render_html(result), encoding="utf-8")
    return str(path)


# --- PNG ------------------------------------------------------------------------------------------------------------


def write_png(result: RouteMap, path: str | Path) -> str:
    """A heat map of routed blocks x tokens: the first causal mode's probability (colour), the reference mode's
    choice (black dots) and the disagreements (red squares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = result.causal_modes[0] if result.causal_modes else result.modes[0]
    n, rows = len(result.tokens), len(result.blocks)
    if mode in result.causal_modes:
        grid = np.array([block.probability[mode] for block in result.blocks])  # (blocks, tokens)
        label = f"{mode}: probability of processing"
    else:
        grid = np.array([block.processed[mode] for block in result.blocks], dtype=float)
        label = f"{mode}: processed"
    width = min(24.0, 3.0 + 0.11 * n)
    fig, ax = plt.subplots(figsize=(width, 1.4 + 0.55 * rows))
    image = ax.imshow(grid, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    if result.reference_mode is not None:
        for row, block in enumerate(result.blocks):
            xs = [i for i, chosen in enumerate(block.processed[result.reference_mode]) if chosen]
            ax.scatter(xs, [row] * len(xs), s=6, color="black", zorder=3)
            if mode in block.disagreement:
                xs = [i for i, differs in enumerate(block.disagreement[mode]) if differs]
                ax.scatter(xs, [row] * len(xs), s=40, marker="s", facecolor="none", edgecolor="red", linewidth=0.8,
                           zorder=4)
    ax.set_yticks(range(rows), [f"block {b.layer}" for b in result.blocks])
    if n <= 160:
        ax.set_xticks(range(n), [_tick(p) for p in result.pieces], fontsize=7, family="monospace")
    else:
        ax.set_xlabel("token position")
    title = f"{result.router} router, colour = {label}"
    if result.reference_mode is not None:
        title += f"; dots = {result.reference_mode} chose; red squares = {mode} disagrees with {result.reference_mode}"
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.02, pad=0.01)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _tick(piece: str) -> str:
    if piece == "":
        return "·"
    return piece.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "␣").replace("$", r"\$")
