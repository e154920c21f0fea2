"""The package layout holds (read from the sources with `ast`, no torch): no import circle, in-function imports
only for heavy optional dependencies, and the README's layout names only paths that exist."""

from __future__ import annotations

import ast
import re
from collections import deque
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Package name -> its folder. modcli_runtime lives under export/ so that it installs without torch.
PACKAGES = {"modcli": ROOT / "modcli", "modcli_runtime": ROOT / "export" / "modcli_runtime"}

# The only modules a function may import for itself. Each one is slow to import, or absent from a plain install,
# and needed by one command only, so importing it at module level would tax `modcli --help` and every other
# command (measured after `import torch` on this machine):
HEAVY_OPTIONAL = (
    "onnx", "onnxscript", "onnxruntime",  # export and the ONNX profile backend: 0.1-0.5 s each, 100k+ objects
    "torch.onnx",  # the exporter's internals, read by a translation while an ONNX export runs (it imports onnxscript)
    "matplotlib",  # figures (plot, sweep, routes): about 0.2 s
    "tensorboard", "torch.utils.tensorboard",  # an extra (`pip install modcli[tensorboard]`)
    "transformers",  # a dev extra, never a dependency of the package
    "gguf",  # an extra (`pip install modcli[gguf]`): `modcli import FILE.gguf` only
    "lm_eval",  # an extra (`pip install modcli[eval]`): `modcli eval --tasks` only; about 1 s, pandas and datasets
    "tokenizers",  # optional for the PyTorch-free runtime (bundles with a tokenizer.json); about 0.1 s
    "torch._dynamo", "torch._inductor",  # --compile and AOTInductor only: about 1 s and 800 modules on top of torch
    "torch.distributed.fsdp", "torch.distributed.tensor",  # under torchrun only: about 0.5 s
)


def module_files(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages (a package is named by its __init__.py)."""
    files = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imported_names(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names one import statement asks for; for `from x import y` both x and x.y (y may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(packages: dict[str, Path] = PACKAGES, root: Path = ROOT) -> dict[str, dict[str, str]]:
    """module -> {module it imports -> "file:line" of the first such import}, over every import statement
    (module level, in functions, under TYPE_CHECKING). A package's __init__ imported by one of its own submodules
    is no edge: Python has already started that __init__ by the time the submodule runs."""
    files = module_files(packages)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {module: {} for module in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in imported_names(module, path, node):
                target = known(name)
                if target is None or target == module:
                    continue
                if files[target].name == "__init__.py" and module.startswith(target + "."):
                    continue
                graph[module].setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return graph


def strongly_connected_components(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's algorithm; every component of two or more modules holds at least one import circle."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(module: str) -> None:
        index[module] = lowlink[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                lowlink[module] = min(lowlink[module], lowlink[target])
            elif target in on_stack:
                lowlink[module] = min(lowlink[module], index[target])
        if lowlink[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [component for component in components if len(component) > 1]


def shortest_circle(graph: dict[str, dict[str, str]], start: str) -> list[str]:
    """The shortest path start -> ... -> start (breadth first), as the list of modules on it."""
    came_from = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(graph[module]):
            if target == start:
                path = [module]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if target not in came_from:
                came_from[target] = module
                queue.append(target)
    raise AssertionError(f"{start} is in no circle")


def import_circles(graph: dict[str, dict[str, str]]) -> list[str]:
    """One shortest circle per group of modules that import each other, each import with its file:line."""
    circles = []
    for component in strongly_connected_components(graph):
        circle = shortest_circle(graph, component[0])
        steps = " -> ".join(f"{a} ({graph[a][b]})" for a, b in pairwise(circle))
        circles.append(f"{steps} -> {circle[-1]}   [circle among {len(component)} modules: {', '.join(component)}]")
    return circles


def test_the_import_graph_sees_imports_of_every_kind_and_names_the_circle(tmp_path):
    sources = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",  # `from x import y` with y a module; pkg is a's own package
        "pkg/b.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .c import Thing\n",
        "pkg/c.py": "def f():\n    import pkg.a\n",
        "pkg/sub/__init__.py": "from .d import X\n",
        "pkg/sub/d.py": "import os\n\nfrom .. import sub\n",  # its own packages: no edge, so no circle with sub
        "other/__init__.py": "",
        "other/e.py": "from pkg.sub import d\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph({"pkg": tmp_path / "pkg", "other": tmp_path / "other"}, root=tmp_path)
    assert {module: sorted(targets) for module, targets in graph.items()} == {
        "pkg": [], "pkg.a": ["pkg.b"], "pkg.b": ["pkg.c"], "pkg.c": ["pkg.a"], "pkg.sub": ["pkg.sub.d"],
        "pkg.sub.d": [], "other": [], "other.e": ["pkg.sub", "pkg.sub.d"]}
    assert import_circles(graph) == ["pkg.a (pkg/a.py:1) -> pkg.b (pkg/b.py:4) -> pkg.c (pkg/c.py:2) -> pkg.a   "
                                     "[circle among 3 modules: pkg.a, pkg.b, pkg.c]"]

    real = import_graph()
    assert any(target.startswith("modcli.commands") for target in real["modcli.cli"])
    assert any(target.startswith("modcli_runtime.") for target in real["modcli_runtime.cli"])


def test_no_import_circle():
    circles = import_circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(circles)


def in_function_imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement inside a function body of this file."""
    found = []
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found += [(node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                found.append((node.lineno, imported_names(module, path, node)[0]))
    return sorted(set(found))  # a nested function's imports are walked once per enclosing function


def is_heavy_optional(name: str) -> bool:
    return any(name == heavy or name.startswith(heavy + ".") for heavy in HEAVY_OPTIONAL)


def test_imports_inside_functions_are_only_heavy_optional_dependencies():
    offenders = [f"{path.relative_to(ROOT)}:{line} {name}"
                 for module, path in module_files().items()
                 for line, name in in_function_imports(path, module)
                 if not is_heavy_optional(name)]
    assert not offenders, (f"{len(offenders)} in-function imports of modules that are neither heavy nor optional "
                           "(import them at module level):\n" + "\n".join(offenders))


def test_in_function_imports_are_found_and_judged(tmp_path):
    path = tmp_path / "example.py"
    path.write_text("import os\n\ndef f():\n    import onnx\n    from matplotlib import pyplot\n"
                    "    from . import sibling\n    def g():\n        import json\n\nclass C:\n"
                    "    def m(self):\n        from torch._inductor import config\n")
    found = in_function_imports(path, "modcli.example")
    assert found == [(4, "onnx"), (5, "matplotlib"), (6, "modcli"), (8, "json"), (12, "torch._inductor")]
    assert [name for _, name in found if not is_heavy_optional(name)] == ["modcli", "json"]
    assert not is_heavy_optional("torch") and not is_heavy_optional("onnxruntime_extensions")


# A layout entry: a name with a file extension or a trailing slash, possibly with folders before it.
PATH_LIKE = re.compile(r"^(?:[\w.-]+/)*(?:[\w-][\w.-]*\.[A-Za-z][A-Za-z0-9]*|[\w.-]+/)$")
TREE_DRAWING = "│├└─┬┼|`+- \t\u00a0"  # box drawing, or ASCII `|-- name`, `` `-- name ``


def layout_section(readme: str) -> str:
    """The text under the first heading that contains "Layout", up to the next heading of its level or above."""
    lines = readme.splitlines()
    for start, line in enumerate(lines):
        heading = re.match(r"^(#+)\s.*layout", line, re.IGNORECASE)
        if heading:
            level = len(heading.group(1))
            end = next((i for i in range(start + 1, len(lines))
                        if re.match(rf"^#{{1,{level}}}\s", lines[i])), len(lines))
            return "\n".join(lines[start + 1:end])
    raise AssertionError("README.md has no heading containing 'Layout'")


def code_block_paths(block: str) -> list[str]:
    """Paths named by a tree (`├── models/  the decoder`, nested by indentation) or by a list of paths
    (`modcli/models/  the decoder`): the first word of each line, joined to the folder it is drawn under."""
    paths = []
    parents: list[tuple[int, str]] = []  # (column of the name, its folder path) for the folders drawn above
    for line in block.splitlines():
        name = line.lstrip(TREE_DRAWING)
        if not name:
            continue
        column = len(line) - len(name)
        word = name.split()[0]
        if not PATH_LIKE.match(word):
            continue  # a description carried over to the next line
        while parents and parents[-1][0] >= column:
            parents.pop()
        path = parents[-1][1] + word if parents else word
        paths.append(path)
        if path.endswith("/"):
            parents.append((column, path))
    return paths


def table_paths(section: str) -> list[str]:
    """The backquoted paths in the first column of a Markdown table."""
    paths = []
    for line in section.splitlines():
        cells = line.strip().strip("|").split("|")
        if line.lstrip().startswith("|") and len(cells) > 1:
            paths += [word for word in re.findall(r"`([^`]+)`", cells[0]) if PATH_LIKE.match(word)]
    return paths


def layout_paths(readme: str) -> list[str]:
    """The layout section's first fenced code block, or, when it has none, its table."""
    section = layout_section(readme)
    block = re.search(r"^\s*(```|~~~)[^\n]*\n(.*?)^\s*\1", section, re.MULTILINE | re.DOTALL)
    return code_block_paths(block.group(2)) if block else table_paths(section)


def test_layout_reader_handles_trees_lists_and_tables():
    tree = ("# modcli\n## Layout\n```text\nmodcli/\n├── config.py        the configs\n├── models/          the decoder\n"
            "│   ├── routing/     routers: top-k,\n│   │                causal rules\n│   └── cache.py\n"
            "└── cli.py\nexport/modcli_runtime/   the runtime\nbench/gpu.sh\n```\n## Next\n```\nnot/this/\n```\n")
    assert layout_paths(tree) == ["modcli/", "modcli/config.py", "modcli/models/", "modcli/models/routing/",
                                  "modcli/models/cache.py", "modcli/cli.py", "export/modcli_runtime/",
                                  "bench/gpu.sh"]
    ascii_tree = "## Layout\n~~~\nexport/\n|-- modcli_runtime/   the runtime\n`-- README.md\n~~~\n"
    assert layout_paths(ascii_tree) == ["export/", "export/modcli_runtime/", "export/README.md"]
    table = "## Package layout\n\n| path | what |\n| --- | --- |\n| `modcli/data/` | corpora |\n| `a.py`, `b/c.py` | x |\n"
    assert layout_paths(table) == ["modcli/data/", "a.py", "b/c.py"]


def test_readme_layout_names_only_paths_that_exist():
    paths = layout_paths((ROOT / "README.md").read_text())
    assert len(paths) >= 5, f"the README's layout names too few paths to be read right: {paths}"
    missing = [path for path in paths if not (ROOT / path).exists() or (path.endswith("/") and not (ROOT / path).is_dir())]
    assert not missing, "README.md's layout names paths that do not exist: " + ", ".join(missing)


def test_no_family_or_router_kind_is_compared_outside_its_own_modules():
    """Commands, training, FLOPs, profiling and export ask a family's spec or a router's capabilities; only the
    family's and the router's own modules (and their registries) may compare a name."""
    from modcli.models.families import FAMILIES
    from modcli.models.routing.registry import ROUTER_KINDS

    names = set(FAMILIES) | set(ROUTER_KINDS)
    own = ("modcli/models/families/", "modcli/models/routing/", "modcli/models/early_exit.py",
           "modcli/models/recursion.py")
    offenders = []
    for path in sorted((ROOT / "modcli").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(own):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = (node.left, *node.comparators)
            constants = [c for c in operands if isinstance(c, ast.Constant | ast.Tuple)]
            values = {e.value for c in constants for e in (c.elts if isinstance(c, ast.Tuple) else [c])
                      if isinstance(e, ast.Constant)}
            # a name compared with what holds a family or router kind (route parts share the word "attention")
            subject = " ".join(ast.unparse(c) for c in operands if c not in constants)
            if values & names and any(word in subject for word in ("arch", "router", "kind", "family")):
                offenders.append(f"{relative}:{node.lineno} compares {sorted(values & names)}")
    assert not offenders, "\n".join(offenders)


# --------------------------------------------------------------------------- links in the documentation resolve

# A Markdown link or image: [text](target) or [text](target "title"); text may hold one level of brackets.
MARKDOWN_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    heading = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def markdown_anchors(text: str) -> set[str]:
    """Every #anchor a Markdown file defines: its headings (a repeated heading gets -1, -2, ...) and <a id=...>."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            anchor = heading_anchor(heading.group(1))
            anchors.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
            seen[anchor] = seen.get(anchor, 0) + 1
        anchors.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return anchors


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """'file:line: target (why)' for each relative link, in prose, to a missing file or a missing #anchor of a
    Markdown file. Links in code (fenced or `inline`) and to other schemes (https:, mailto:) are not read."""
    broken = []
    for path in files:
        for number, line in prose_lines(path.read_text()):
            for target in MARKDOWN_LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target):
                    continue
                file, _, anchor = target.partition("#")
                destination = (path.parent / file).resolve() if file else path
                where = f"{path.relative_to(root)}:{number}: {target}"
                if not destination.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and destination.suffix == ".md" and anchor not in markdown_anchors(destination.read_text()):
                    broken.append(f"{where} (no such heading in {destination.relative_to(root)})")
    return broken


def documentation_files(root: Path = ROOT) -> list[Path]:
    """README.md, every page under docs/, bench/README.md and export/README.md."""
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md")), root / "bench" / "README.md",
             root / "export" / "README.md"]
    return [path for path in files if path.exists()]


def test_link_checker_finds_missing_files_and_anchors_and_reads_no_code(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n## Speed per backend: eager, `compiled` (CPU, issue 13's targets)\n## Notes\n## Notes\n"
        "<a id=\"kept-anchor\"></a>\n```bash\n# not a heading\n[no](missing.md)\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md#speed-per-backend-eager-compiled-cpu-issue-13s-targets) [dup](docs/page.md#notes-1)\n"
        "[kept](docs/page.md#kept-anchor) [self](#readme) [web](https://example.com/x.md#y) `[code](gone.md)`\n"
        "# Readme\n![figure](docs/figure.png) [gone](docs/gone.md) [bad](docs/page.md#not-a-heading)\n"
        "[fenced](docs/page.md#not-a-heading-1)\n")
    assert broken_links([tmp_path / "README.md"], tmp_path) == [
        "README.md:4: docs/figure.png (no such file)",
        "README.md:4: docs/gone.md (no such file)",
        "README.md:4: docs/page.md#not-a-heading (no such heading in docs/page.md)",
        "README.md:5: docs/page.md#not-a-heading-1 (no such heading in docs/page.md)",
    ]


def test_every_relative_link_and_anchor_in_the_documentation_resolves():
    files = documentation_files()
    assert ROOT / "docs" / "results.md" in files
    broken = broken_links(files)
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_every_readme_number_links_to_the_results():
    """Each bullet of the README's Results section links to docs/results.md or a page under docs/results/ (or to
    the page of the documentation that holds the measurement)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    bullets = re.split(r"\n- ", section)[1:]
    assert bullets, "README.md's Results section has no bullets"
    unlinked = [bullet.split("\n")[0] for bullet in bullets
                if not re.search(r"\]\(docs/(results(\.md|/)|pretrained[\w-]*\.md)", bullet)]
    assert not unlinked, "README results without a link to docs/results.md:\n" + "\n".join(unlinked)


def test_results_index_is_short_and_bench_lists_every_script():
    """docs/results.md is the index (the history lives under docs/results/); bench/README.md names every script
    in bench/, and bench/ holds no more entry points than questions it answers."""
    assert len((ROOT / "docs" / "results.md").read_text().splitlines()) <= 300
    listing = (ROOT / "bench" / "README.md").read_text()
    scripts = sorted(path.name for path in (ROOT / "bench").iterdir() if path.suffix in (".py", ".sh"))
    unlisted = [name for name in scripts if f"`{name}`" not in listing and f"bench/{name}" not in listing]
    assert not unlisted, "bench/README.md does not name: " + ", ".join(unlisted)
    entry_points = listing.split("## Entry points", 1)[1].split("\n## ", 1)[0]
    assert len(re.findall(r"^\| [^-|]", entry_points, re.MULTILINE)) - 1 <= 13
