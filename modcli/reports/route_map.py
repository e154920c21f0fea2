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

import dataclasses
import html
import json
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

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
    """Route only N tokens from --start; None = all of them (`modcli routes --out routes.png`: 512, a window a
    person can read)."""
    start: int = 0
    """The first token to route (0 = the text's first). Windows of seq_len still start at the text's start, so a
    token's decisions do not depend on --start."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""

    def __post_init__(self) -> None:
        require(self.max_tokens is None or self.max_tokens >= 1, f"--max-tokens must be >= 1, got {self.max_tokens}")
        require(self.start >= 0, f"--start must be >= 0, got {self.start}")


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
    start: int = 0
    """Index in the whole text's tokens of the first token here (--start)."""
    text_tokens: int | None = None
    """Tokens in the whole text (None: these are all of them)."""


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
    tokenizer = load_tokenizer(run_config.data.tokenizer, checkpoint.parent, model.config.vocab_size)
    ids = tokenizer.encode(text)
    pieces = token_pieces(tokenizer, text, ids)
    if not ids:
        raise UserError(f"--text: {path} holds no tokens")
    total, start = len(ids), config.start
    if start >= total:
        raise UserError(f"--start {start} is past the end of {path} ({total} tokens)")
    end = total if config.max_tokens is None else min(total, start + config.max_tokens)
    # Route the text's own windows that hold [start, end), then keep [start, end): the same decisions as routing
    # the whole text, at the cost of at most two windows more.
    seq_len = model.config.seq_len
    first, last = start // seq_len * seq_len, min(total, -(-end // seq_len) * seq_len)
    routed = route_tokens(model, ids[first:last], pieces[first:last], str(checkpoint), tokenizer.name)
    return _window(routed, start - first, end - first, offset=first, text_tokens=total)


def _window(result: RouteMap, lo: int, hi: int, offset: int, text_tokens: int) -> RouteMap:
    """Tokens [lo, hi) of `result` (whose first token is token `offset` of a text of `text_tokens`), the fractions
    counted over them."""
    blocks = []
    for block in result.blocks:
        processed = {m: v[lo:hi] for m, v in block.processed.items()}
        disagreement = {m: v[lo:hi] for m, v in block.disagreement.items()}
        blocks.append(BlockRoutes(
            layer=block.layer, processed=processed, probability={m: v[lo:hi] for m, v in block.probability.items()},
            disagreement=disagreement, processed_fraction={m: sum(v) / len(v) for m, v in processed.items()},
            disagreement_fraction={m: sum(v) / len(v) for m, v in disagreement.items()}))
    return dataclasses.replace(result, tokens=result.tokens[lo:hi], pieces=result.pieces[lo:hi], blocks=blocks,
                               start=offset + lo, text_tokens=text_tokens)


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
            f'{len(result.tokens)} tokens{_span(result)} ({html.escape(result.tokenizer)}), windows of {result.seq_len}'
            '</h1>\n'
            f'<p>{switches}</p><p class="stats">{html.escape(legend)}</p>\n' + "\n".join(sections) + "\n</body></html>\n")


def _span(result: RouteMap) -> str:
    """" (tokens a-b of N)" when the map holds part of the text, else ""."""
    if result.text_tokens in (None, len(result.tokens)):
        return ""
    return f" (tokens {result.start}-{result.start + len(result.tokens) - 1} of {result.text_tokens})"


def write_html(result: RouteMap, path: str | Path) -> str:
    Path(path).write_text(render_html(result), encoding="utf-8")
    return str(path)


# --- PNG ------------------------------------------------------------------------------------------------------------


PNG_WINDOW = 512
"""Tokens `modcli routes --out routes.png` draws without --max-tokens: a few readable rows per block."""
PNG_MAX_TOKENS = 4096
"""The most tokens a PNG draws (about 50 rows of text); the HTML page has no limit."""
PNG_COLUMNS = 100
"""Character cells per row of text before it wraps."""

# Layout in pixels at 100 dpi (the file is written at 150 dpi): a character cell, a row of text, one strip per
# routed block under it, the gap between rows, the margin that holds the labels.
CELL_W, TEXT_H, STRIP_H, ROW_GAP, LEFT, RIGHT, LINE_H = 9, 17, 9, 8, 58, 14, 15


def _glyphs(piece: str) -> list[tuple[str, bool]]:
    """The characters that draw one token, each with whether the row ends after it. A newline draws as ↵ and ends
    the row, a tab as →, another control character as ·; an empty piece (a continuation byte of a multi-byte
    character, whose text is on its first byte) as a faint · so that every token has a cell."""
    if piece == "":
        return [("·", False)]
    glyphs = []
    for char in piece:
        if char == "\n":
            glyphs.append(("↵", True))
        elif char == "\t":
            glyphs.append(("→", False))
        elif char == "\r" or (ord(char) < 32 or 0x7F <= ord(char) < 0xA0):
            glyphs.append(("·", False))
        else:
            glyphs.append((char, False))
    return glyphs


def layout_rows(pieces: list[str], columns: int = PNG_COLUMNS) -> list[list[tuple[int, int, str]]]:
    """The tokens' text in rows of at most `columns` cells, as a console shows it: each row a list of (token index,
    column, character). A newline ends its row; a row that is full wraps; every token has at least one cell, in
    order; a token longer than the room left continues on the next row."""
    if columns < 1:
        raise ValueError(f"columns must be >= 1, got {columns}")
    rows: list[list[tuple[int, int, str]]] = [[]]
    for index, piece in enumerate(pieces):
        for char, ends_row in _glyphs(piece):
            if len(rows[-1]) == columns:
                rows.append([])
            rows[-1].append((index, len(rows[-1]), char))
            if ends_row:
                rows.append([])
    if not rows[-1] and len(rows) > 1:
        rows.pop()
    return rows


def _runs(row: list[tuple[int, int, str]]) -> list[tuple[int, int, int]]:
    """(token index, first column, cells) of each token's cells in one row."""
    runs: list[tuple[int, int, int]] = []
    for index, column, _ in row:
        if runs and runs[-1][0] == index:
            runs[-1] = (index, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((index, column, 1))
    return runs


def png_header(result: RouteMap, mode: str) -> list[str]:
    """The lines above the text: what was routed, how to read the strips, each block's shares, and how to see the
    rest of the text."""
    n, total = len(result.tokens), result.text_tokens or len(result.tokens)
    lines = [f"{result.checkpoint}: {result.router} router, tokens {result.start}-{result.start + n - 1} of {total} "
             f"({result.tokenizer}; routed in windows of {result.seq_len})"]
    what = (f"the probability that {mode} processes the token (darker = surer yes)" if mode in result.causal_modes
            else f"{mode} processed the token")
    legend = f"Under each row of text, one strip per routed block. Blue: {what}."
    if result.reference_mode is not None and mode != result.reference_mode:
        legend += (f" Black bar: {result.reference_mode} (non-causal) chose the token. Red box: {mode} and "
                   f"{result.reference_mode} chose differently.")
    lines.append(legend)
    stats = []
    for block in result.blocks:
        text = f"block {block.layer}: {mode} processed {block.processed_fraction[mode]:.1%}"
        if result.reference_mode is not None and mode in block.disagreement:
            text += (f", {result.reference_mode} {block.processed_fraction[result.reference_mode]:.1%}, they differ on "
                     f"{block.disagreement_fraction[mode]:.1%}")
        stats.append(text)
    lines.append("; ".join(stats) + ".")
    if n < total:
        lines.append("Another window: --start N --max-tokens N (at most "
                     f"{PNG_MAX_TOKENS}); the whole text in every mode: --out routes.html.")
    return lines


def write_png(result: RouteMap, path: str | Path, columns: int = PNG_COLUMNS) -> str:
    """The text as a console shows it, wrapped at `columns` cells, and under each row one strip per routed block:
    the first causal mode's probability of processing each token (blue), the reference mode's choice (a black
    bar) and where the two disagree (a red box). Draws at most PNG_MAX_TOKENS tokens (`route_map`'s --start and
    --max-tokens choose them); the HTML page holds any length."""
    if len(result.tokens) > PNG_MAX_TOKENS:
        raise UserError(f"a PNG draws at most {PNG_MAX_TOKENS} tokens, got {len(result.tokens)}: give --max-tokens "
                        "(and --start), or --out routes.html for the whole text")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    mode = result.causal_modes[0] if result.causal_modes else result.modes[0]
    reference = result.reference_mode if result.reference_mode != mode else None
    rows = layout_rows(result.pieces, columns)
    width = LEFT + columns * CELL_W + RIGHT
    header = [part for line in png_header(result, mode)  # ~7 px a character at 8.5 points, bold a little wider
              for part in textwrap.wrap(line, width=int((width - 16) / 7.2)) or [""]]
    top = 10 + LINE_H * len(header) + 8
    row_h = TEXT_H + STRIP_H * len(result.blocks) + ROW_GAP
    height = top + row_h * len(rows) + 6

    fig = plt.figure(figsize=(width / 100, height / 100), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    for i, line in enumerate(header):
        ax.text(8, 10 + LINE_H * i, line, fontsize=8.5, va="top", ha="left", parse_math=False,
                weight="bold" if i == 0 else "normal")
    cmap = plt.get_cmap("Blues")
    cells, colours, chosen, differs = [], [], [], []
    for r, row in enumerate(rows):
        y = top + r * row_h
        if row:
            ax.text(LEFT - 6, y + TEXT_H / 2, str(result.start + row[0][0]), fontsize=6.5, color="#999", ha="right",
                    va="center", parse_math=False)
        for index, column, char in row:
            if char != " ":
                faint = char in "↵→·" and char != result.pieces[index]
                ax.text(LEFT + (column + 0.5) * CELL_W, y + TEXT_H / 2 + 1, char, fontsize=10, ha="center",
                        va="center", family="DejaVu Sans Mono", color="#aaa" if faint else "#111", parse_math=False)
        for b, block in enumerate(result.blocks):
            strip_y = y + TEXT_H + b * STRIP_H
            if r == 0 or len(result.blocks) > 1:
                ax.text(LEFT - 6, strip_y + STRIP_H / 2, f"b{block.layer}", fontsize=6, color="#666", ha="right",
                        va="center")
            values = block.probability.get(mode) or [float(v) for v in block.processed[mode]]
            for index, column, span in _runs(row):
                x = LEFT + column * CELL_W + 0.5
                cells.append(Rectangle((x, strip_y + 0.5), span * CELL_W - 1, STRIP_H - 1.5))
                colours.append(cmap(0.06 + 0.84 * values[index]))
                if reference is not None and block.processed[reference][index]:
                    chosen.append(Rectangle((x, strip_y + STRIP_H - 3.5), span * CELL_W - 1, 2.5))
                if reference is not None and block.disagreement.get(mode) and block.disagreement[mode][index]:
                    differs.append(Rectangle((x - 0.5, strip_y), span * CELL_W, STRIP_H - 0.5))
    ax.add_collection(PatchCollection(cells, facecolors=colours, edgecolors="none"))
    ax.add_collection(PatchCollection(chosen, facecolors="black", edgecolors="none"))
    ax.add_collection(PatchCollection(differs, facecolors="none", edgecolors="#d00", linewidths=1.0))
    with warnings.catch_warnings():  # a character the monospace font lacks draws as a box; no warning per glyph
        warnings.simplefilter("ignore", UserWarning)
        fig.savefig(path, dpi=150)
    plt.close(fig)
    return str(path)
