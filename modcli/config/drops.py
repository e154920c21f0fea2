"""Static drops (`--drop attention:25-29,mlp:28`): sublayers removed for every token, parsed and checked here.

A dropped sublayer computes nothing and holds no weights; a dropped attention stores no keys and values (its layer
has no KV cache). The text is kept canonical in ModelConfig.drop (config.json, TOML plans, sweep grids), e.g.
"attention:25-29,mlp:28": parts in the order attention, mlp, each block list as sorted ranges. "block:N" drops both
sublayers of block N. Torch-free: configuration and FLOP counts read it without importing a model.
"""

from __future__ import annotations

from modcli.errors import UserError

DROP_PARTS = ("attention", "mlp")
"""The sublayers a static drop removes ("block" in the flag names both)."""


def parse_drops(text: str, n_layers: int) -> dict[str, tuple[int, ...]]:
    """"attention:25-29,mlp:28" -> {"attention": (25, ..., 29), "mlp": (28,)}; every mistake one line naming --drop.

    Items are comma-separated `PART:RANGE` with PART attention, mlp or block and RANGE a block `N` or `A-B`
    (inclusive); an item without a part continues the previous item's part ("attention:1,3-4"). A block named twice
    for one part (overlapping ranges), an empty range (B < A), a block outside 0..n_layers-1, or every block of a part
    dropped (nothing would be left of it) is refused."""
    drops: dict[str, set[int]] = {part: set() for part in DROP_PARTS}
    for part, blocks in part_items(text, (*DROP_PARTS, "block"), n_layers, "--drop", "attention:25-29,mlp:28"):
        for name in DROP_PARTS if part == "block" else (part,):
            twice = drops[name] & blocks
            if twice:
                raise UserError(f"--drop: block {min(twice)} is named twice for {name} (overlapping ranges) in "
                                f"{text!r}")
            drops[name] |= blocks
    for name, blocks in drops.items():
        if len(blocks) == n_layers:
            raise UserError(f"--drop removes the {name} of every block (0-{n_layers - 1}): nothing would be left of "
                            f"it; drop fewer blocks")
    return {name: tuple(sorted(blocks)) for name, blocks in drops.items() if blocks}


def part_items(text: str, parts: tuple[str, ...], n_layers: int, flag: str,
               example: str) -> list[tuple[str, set[int]]]:
    """The items of a `PART:BLOCKS,...` list (--drop, a per-block --route-part) as (part, blocks), in order: items are
    comma-separated, PART one of `parts`, BLOCKS a block `N` or a range `A-B` (inclusive); an item without a part
    continues the previous item's part ("attention:1,3-4"). An unknown part, an item before any part, an empty
    range or a block outside 0..n_layers-1 is one line naming `flag`."""
    items: list[tuple[str, set[int]]] = []
    part = None
    for item in (piece.strip() for piece in text.split(",")):
        if not item:
            continue
        if ":" in item:
            part, _, item = (piece.strip() for piece in item.partition(":"))
            if part not in parts:
                raise UserError(f"{flag}: unknown part {part!r} ({', '.join(parts)}), in {text!r}")
        if part is None:
            raise UserError(f"{flag}: {item!r} names no part; write PART:BLOCKS, e.g. {example}")
        items.append((part, _block_range(item, text, n_layers, flag)))
    return items


def parse_block_list(text: str, n_layers: int, flag: str) -> tuple[int, ...]:
    """"20-29" or "1,3-4" -> the sorted blocks; an empty list, an empty or overlapping range or a block outside
    0..n_layers-1 is one line naming `flag`."""
    blocks: set[int] = set()
    for item in (piece.strip() for piece in text.split(",")):
        if not item:
            continue
        more = _block_range(item, text, n_layers, flag)
        if blocks & more:
            raise UserError(f"{flag}: block {min(blocks & more)} is named twice (overlapping ranges) in {text!r}")
        blocks |= more
    if not blocks:
        raise UserError(f"{flag}: no block named in {text!r}; write blocks as N or A-B, e.g. 20-29")
    return tuple(sorted(blocks))


def _block_range(item: str, text: str, n_layers: int, flag: str = "--drop") -> set[int]:
    first, dash, last = item.partition("-")
    try:
        start, end = int(first), int(last) if dash else int(first)
    except ValueError:
        raise UserError(f"{flag}: {item!r} is not a block or a range A-B, in {text!r}") from None
    if end < start:
        raise UserError(f"{flag}: the range {item} is empty (write the smaller block first), in {text!r}")
    if start < 0 or end >= n_layers:
        raise UserError(f"{flag}: block {end if end >= n_layers else start} is out of range: the model has blocks "
                        f"0-{n_layers - 1}, in {text!r}")
    return set(range(start, end + 1))


def format_drops(drops: dict[str, tuple[int, ...]]) -> str:
    """The canonical text: parts in DROP_PARTS order, each block list as ranges ("attention:25-29,mlp:28")."""
    return ",".join(f"{part}:{format_block_list(drops[part])}" for part in DROP_PARTS if drops.get(part))


def format_block_list(blocks: tuple[int, ...]) -> str:
    """(1, 3, 4, 5) -> "1,3-5"."""
    spans: list[list[int]] = []
    for block in blocks:
        if spans and block == spans[-1][1] + 1:
            spans[-1][1] = block
        else:
            spans.append([block, block])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
