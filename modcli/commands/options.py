"""Every flag of the command line, declared once: one type, one default, one help text.

A command's signature names its flags with the types below (`capacity: options.Capacity = None`) and hands the
parsed values to its config by field name (`build`), so a flag exists in one place and a command only lists it.

Defaults. Every flag that sets a config field defaults to None, "not given": the config's own value stands (the
dataclass default, the preset's, the TOML file's, or a resumed run's). So `--seed` not given is TrainConfig's,
GenerateConfig's, ExportConfig's and ProfileConfig's seed, 1337 in each, and a resumed run keeps the seed it was
trained with. Only a flag that no config holds has a value of its own (--json off, plot's --smooth 10); a few
commands supply a default where their library function takes none (plot's and routes' --out, sweep's --out).

Help. A flag that sets one config field takes that field's docstring as its help, read with `ast` from the
config's source: the dataclass docs and `--help` cannot drift apart, and reading the source costs ~40 ms where
importing the library modules would import torch (seconds) for `modcli --help`. Deriving costs the ~50 lines
below (`_declared_fields` to `field_argument`); the ~65 hand-written help texts it replaces had drifted from the
docstrings, and the copies of one flag from each other. The field's default is shown after it unless a preset
sets the field. Help stays here instead for a flag whose spelling differs from the field's (comma-separated
lists, where the field holds a list) and for a flag that several commands share with a meaning of their own in each
(--dtype, --seed, ...): one text that says what it does in each. --out, where each command writes something of its
own, and CHECKPOINT (runs/latest by default, a fresh model in profile) are declared once per command that differs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from modcli.commands.common import USAGE_ERROR
from modcli.config import PRESETS

_PACKAGE = Path(__file__).resolve().parent.parent
_PRESET_FIELDS = {name for preset in PRESETS.values() for name in preset}

# Where each config lives (module under modcli/, class): read as source, never imported here.
MODEL = ("config/model.py", "ModelConfig")
DATA = ("config/data.py", "DataConfig")
TRAIN = ("config/training.py", "TrainConfig")
EVAL = ("evaluation/perplexity.py", "EvalConfig")
HARNESS = ("evaluation/harness.py", "HarnessConfig")
GENERATE = ("decode/generation.py", "GenerateConfig")
EXPORT = ("bundle/config.py", "ExportConfig")
PROFILE = ("profiling/config.py", "ProfileConfig")
IMPORT = ("pretrained/importer.py", "ImportConfig")
ROUTES = ("reports/route_map.py", "RouteConfig")
SWEEP = ("sweep/grid.py", "SweepConfig")
TOKENIZER = ("data/tokenizer_training.py", "TokenizerTrainConfig")

_NOT_A_LITERAL = object()


@functools.cache
def _declared_fields(module: str) -> dict[str, dict[str, tuple[str, Any]]]:
    """{class: {field: (docstring, default)}} of the classes in modcli/<module>, as the source declares them: a
    field is an annotated name followed by a string; a default that is not a literal (a `field(...)` call, a
    constant's name) is _NOT_A_LITERAL."""
    tree = ast.parse((_PACKAGE / module).read_text(encoding="utf-8"))
    classes = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = {}
        for statement, following in zip(node.body, node.body[1:], strict=False):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                try:
                    default = None if statement.value is None else ast.literal_eval(statement.value)
                except ValueError:
                    default = _NOT_A_LITERAL
                fields[statement.target.id] = (following.value.value, default)
        classes[node.name] = fields
    return classes


def field_help(config: tuple[str, str], name: str) -> str:
    """The docstring of `name` in `config` as one line of help; "None = x" reads "default: x" on the command line,
    where None is a flag not given."""
    module, class_name = config
    declared = _declared_fields(module).get(class_name, {})
    if name not in declared:
        raise KeyError(f"{class_name} in modcli/{module} declares no documented field {name!r}")
    return " ".join(declared[name][0].split()).replace("None = ", "default: ")


def _with_default(config: tuple[str, str], name: str, text: str, switch: str | None) -> str:
    """`text` and the field's default as typer shows one ("[default: 16]"), unless the default is None, not a
    literal, or set by a preset (train's and profile's presets differ)."""
    module, class_name = config
    default = _declared_fields(module)[class_name][name][1]
    if default is None or default is _NOT_A_LITERAL or name in _PRESET_FIELDS:
        return text
    if isinstance(default, bool):  # a switch: the spelling that is on by default, where it has two
        on, _, off = (switch or "").removeprefix("--").partition("/--")
        if not off:
            return text
        default = on if default else off
    return f"{text} [default: {default}]"


def field_option(config: tuple[str, str], name: str, *declarations: str, help: str | None = None) -> Any:
    """The option that sets field `name` of `config`: its docstring as help (or `help`), with its default."""
    switch = next((d for d in declarations if "/" in d), None)
    text = _with_default(config, name, help or field_help(config, name), switch)
    return typer.Option(*declarations, help=escape(text), show_default=False)


def field_argument(config: tuple[str, str], name: str, help: str | None = None) -> Any:
    return typer.Argument(help=escape(help or field_help(config, name)), show_default=False)


def given(ctx: typer.Context) -> dict[str, Any]:
    """The command's flags and arguments that were given, by parameter name, as click parsed them: a repeatable
    option arrives as a tuple (here a list; an empty one, never given, is left out like a None)."""
    values = {}
    for name, value in ctx.params.items():
        if isinstance(value, tuple):
            value = list(value) or None
        if value is not None:
            values[name] = value
    return values


def build(config_class: type, values: dict[str, Any]) -> Any:
    """`config_class` from the values named like its fields; a field without a value (or None) keeps its default."""
    names = {field.name for field in dataclasses.fields(config_class)}
    return config_class(**{name: value for name, value in values.items() if name in names and value is not None})


# ------------------------------------------------------------------------------------ shared by several commands

LATEST_RUN = "runs/latest"
"""Where `modcli train` writes without --out, and what eval, generate, export and routes read without CHECKPOINT."""


def _latest_run_if_none(value: str | None) -> str:
    """CHECKPOINT not given: runs/latest where it exists (what `modcli train` just wrote), else one line saying
    what to give."""
    if value is not None:
        return value
    if not Path(LATEST_RUN).exists():
        raise USAGE_ERROR(f"no CHECKPOINT given and no {LATEST_RUN} here (where `modcli train` writes without --out): "
                          "name a run or checkpoint folder")
    return LATEST_RUN


Checkpoint = Annotated[Optional[str], typer.Argument(
    help=f"Run folder (its newest checkpoint) or checkpoint folder; default {LATEST_RUN} where it exists.",
    show_default=False, callback=_latest_run_if_none)]
"""eval's, generate's, export's and routes' CHECKPOINT (`checkpoint: options.Checkpoint = None`)."""
FreshOrCheckpoint = Annotated[Optional[str], typer.Argument(
    help="Run folder (its newest checkpoint) or checkpoint folder; default: a freshly initialised model.",
    show_default=False)]
"""profile's CHECKPOINT: without one it measures a fresh model of --preset and the model flags."""
BatchSize = Annotated[Optional[int], typer.Option(
    help="Sequences per batch: train's micro-batch (default: the preset's), eval's and profile's batch (default 8; eval "
         "--tasks: requests per forward pass).")]
Compile = Annotated[Optional[bool], typer.Option("--compile", help=(
    "torch.compile: train the model; generate the causal prefill and a static-shape decode step (a CUDA graph on "
    "CUDA; compile time reported apart); profile adds compiled to --backends; export also writes torch.export .pt2 "
    "programs and AOTInductor packages (slow: a C++ compile)."))]
PackedLinears = Annotated[Optional[bool], typer.Option("--packed-linears/--no-packed-linears", help=(
    "CPU float32 inference (generate's eager decoding, eval's perplexity and --tasks, profile's eager forward, "
    "prefill and decode step of both models): nn.Linear through oneDNN's prepacked kernel, 1.8-2x faster end to end on "
    "SmolLM2-135M on AMD CPUs, where MKL is slow; on Intel MKL is as fast or faster. Default: on for AMD CPUs, off "
    "elsewhere; --no-packed-linears: PyTorch's default BLAS. Never in training."))]
ConfigFile = Annotated[Optional[Path], typer.Option(
    "--config", help="TOML file with the same keys as the flags, each of its flag's type, and preset (--preset "
                     "wins over it); flags win.")]
Data = Annotated[Optional[str], typer.Option(help=(
    "Corpus: a text file, a folder of files (see --glob) or, for train and eval, a tokenised .bin; default: the "
    "built-in Python stdlib corpus (eval: the validation split the run was trained on)."))]
Device = Annotated[Optional[str], typer.Option(
    help="auto (cuda, then mps, then cpu), cpu, cuda or mps; default auto (sweep: the grid's).")]
Dtype = Annotated[Optional[str], typer.Option(help=(
    "float32 (default), bfloat16 or float16: the autocast dtype (sweep: instead of the grid's); export: the graphs' "
    "weights and activations (bfloat16 only with --no-onnx --compile); import: the saved weights."))]
Glob = Annotated[Optional[str], field_option(DATA, "glob")]
Json = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]
_ONNX_HELP = ("ONNX through onnxruntime: export writes the graphs that modcli-run runs (default on; --no-onnx: "
              "none); profile also times this `modcli export` bundle (repeat: e.g. the MoD and the dense bundle).")
OnnxGraphs = Annotated[Optional[bool], typer.Option("--onnx/--no-onnx", help=_ONNX_HELP)]
"""export's --onnx: a switch."""
OnnxBundles = Annotated[Optional[list[str]], typer.Option(help=_ONNX_HELP)]
"""profile's --onnx: bundles, repeated."""
# --out: each command writes something of its own, so each has its own help (and default) for it.
TrainOut = Annotated[Optional[str], typer.Option("--out", help=(
    f"Run folder: checkpoints, metrics.jsonl, the config (default {LATEST_RUN}, what eval, generate, export and "
    "routes read without CHECKPOINT)."))]
ImportOut = Annotated[Optional[str], typer.Option("--out", help="Run folder to write the imported model into (required).")]
ExportOut = Annotated[Optional[str], typer.Option("--out", help=(
    "Folder to write: the ONNX bundle or, with --hf, the Hugging Face folder (default bundles/latest)."))]
SweepOut = Annotated[Optional[str], typer.Option("--out", help=(
    "Sweep folder: grid.toml, results.jsonl, runs/ (default runs/sweeps/GRID-NAME)."))]
PlotOut = Annotated[Optional[str], typer.Option("--out", help="PNG file to draw the curves in (default curves.png).")]
RoutesOut = Annotated[Optional[str], typer.Option("--out", help=(
    "routes.html (default; the whole text, every block) or routes.png (a readable window of --max-tokens tokens "
    "from --start)."))]
TokenizerOut = Annotated[Optional[str], typer.Option("--out", help=(
    "tokenizer.json to write (default tokenizer.json)."))]
Preset = Annotated[Optional[str], typer.Option(
    help="tiny, small or base: the values --config and the flags start from (default: train tiny, profile small).")]
_ROUTING_HELP = ("A routing mode of the model's router (topk router: topk, router or predictor). eval: each mode "
                 "given (repeat; default all); eval --tasks, generate, export's decode graph, profile's prefill and "
                 "decode: one causal mode (default: the router's first).")
RoutingModes = Annotated[Optional[list[str]], typer.Option(help=_ROUTING_HELP)]
"""eval's --routing: modes, repeated."""
Routing = Annotated[Optional[str], typer.Option(help=_ROUTING_HELP)]
"""The --routing of generate, export and profile: one causal mode."""
Seed = Annotated[Optional[int], typer.Option(help=(
    "Random seed (default 1337): train's weights, data order and dropout; generate's sampler; export's random "
    "validation tokens; profile's fresh weights and inputs."))]
SeqLen = Annotated[Optional[int], typer.Option(help=(
    "Sequence length in tokens: train's context (default: the preset's), import's (default "
    "min(max_position_embeddings, 1024)); the length profile measures (default: the model's)."))]
RoutesText = Annotated[Optional[str], typer.Option("--text", help="UTF-8 text file to route (required).")]
ExportText = Annotated[Optional[str], typer.Option("--text", help=(
    "UTF-8 text file the real-text checks read (default: the stdlib's textwrap.py)."))]
VocabSize = Annotated[Optional[int], typer.Option(help=(
    "Vocabulary size: the model's (256 for byte tokens; match a --tokenizer's), or the tokens tokenizer train "
    "learns, the 256 bytes included (default 4096)."))]
Warmup = Annotated[Optional[int], typer.Option(help=(
    "Warm-up: train's linear learning-rate warm-up steps (default: the preset's); profile's untimed calls before "
    "the timed ones (default 1)."))]

# ---------------------------------------------------------------- a fresh model's shape and routing (ModelConfig)

DModel = Annotated[Optional[int], field_option(MODEL, "d_model")]
NLayers = Annotated[Optional[int], field_option(MODEL, "n_layers")]
NHeads = Annotated[Optional[int], field_option(MODEL, "n_heads")]
MlpHidden = Annotated[Optional[int], field_option(MODEL, "mlp_hidden")]
Dropout = Annotated[Optional[float], field_option(MODEL, "dropout")]
Capacity = Annotated[Optional[float], field_option(MODEL, "capacity")]
RouteEvery = Annotated[Optional[int], field_option(MODEL, "route_every")]
RouteOffset = Annotated[Optional[int], field_option(MODEL, "route_offset")]
RouteLayers = Annotated[Optional[str], field_option(
    MODEL, "route_layers", help="Route exactly these blocks, comma-separated (e.g. 1,3,5), instead of --route-every.")]
Router = Annotated[Optional[str], field_option(MODEL, "router")]
RouterWeight = Annotated[Optional[str], field_option(MODEL, "router_weight")]
RouterHidden = Annotated[Optional[int], field_option(MODEL, "router_hidden")]
Threshold = Annotated[Optional[float], field_option(MODEL, "threshold")]
CapacityMax = Annotated[Optional[float], field_option(MODEL, "capacity_max")]
RoutePart = Annotated[Optional[str], field_option(MODEL, "route_part")]
PredictorHidden = Annotated[Optional[int], field_option(MODEL, "predictor_hidden")]
KeepFirst = Annotated[Optional[int], field_option(MODEL, "keep_first")]
Experts = Annotated[Optional[int], field_option(MODEL, "experts")]
ExpertTopK = Annotated[Optional[int], field_option(MODEL, "expert_top_k")]
ExpertCapacityFactor = Annotated[Optional[float], field_option(MODEL, "expert_capacity_factor")]
NoopExperts = Annotated[Optional[int], field_option(MODEL, "noop_experts")]
AttentionScore = Annotated[Optional[str], field_option(MODEL, "attention_score")]
ExpertWeight = Annotated[Optional[str], field_option(MODEL, "expert_weight")]
ExpertRouting = Annotated[Optional[str], field_option(MODEL, "expert_routing")]
HashTable = Annotated[Optional[str], field_option(MODEL, "hash_table")]
Arch = Annotated[Optional[str], field_option(MODEL, "arch")]
LayerDropoutMax = Annotated[Optional[float], field_option(MODEL, "layer_dropout_max")]
ExitLossScale = Annotated[Optional[float], field_option(MODEL, "exit_loss_scale")]
Recursions = Annotated[Optional[int], field_option(MODEL, "recursions")]
RecursionCapacities = Annotated[Optional[str], field_option(MODEL, "recursion_capacities", help=(
    "--arch recursion: share of the tokens each recursion step keeps, comma-separated, non-increasing, in (0, 1]; "
    "default (N - r) / N for step r of N (1,0.67,0.33 for N = 3)."))]
RecursionUpdate = Annotated[Optional[str], field_option(MODEL, "recursion_update")]
RecursionAlpha = Annotated[Optional[float], field_option(MODEL, "recursion_alpha")]
Dense = Annotated[Optional[bool], typer.Option("--dense", help="The dense twin: routing off (--route-every 0).")]

# --------------------------------------------------------------------------------- train (DataConfig, TrainConfig)

Tokenizer = Annotated[Optional[str], field_option(DATA, "tokenizer")]
GradAccum = Annotated[Optional[int], field_option(TRAIN, "grad_accum")]
Lr = Annotated[Optional[float], field_option(TRAIN, "lr")]
MaxSteps = Annotated[Optional[int], field_option(TRAIN, "max_steps")]
FlopsBudget = Annotated[Optional[float], field_option(TRAIN, "flops_budget")]
RouterAuxWeight = Annotated[Optional[float], field_option(TRAIN, "router_aux_weight")]
ExpertAuxWeight = Annotated[Optional[float], field_option(TRAIN, "expert_aux_weight")]
ExpertCapacityWarmup = Annotated[Optional[int], field_option(TRAIN, "expert_capacity_warmup")]
ExpertAuxSum = Annotated[Optional[bool], field_option(TRAIN, "expert_aux_sum", "--expert-aux-sum/--expert-aux-mean")]
RouterLrScale = Annotated[Optional[float], field_option(TRAIN, "router_lr_scale")]
ExpertGateLrScale = Annotated[Optional[float], field_option(TRAIN, "expert_gate_lr_scale")]
CapacityWarmup = Annotated[Optional[int], field_option(TRAIN, "capacity_warmup")]
EvalEvery = Annotated[Optional[int], field_option(TRAIN, "eval_every")]
EvalBatches = Annotated[Optional[int], field_option(TRAIN, "eval_batches")]
LogEvery = Annotated[Optional[int], field_option(TRAIN, "log_every")]
Resume = Annotated[Optional[bool], field_option(TRAIN, "resume", "--resume")]
InitFrom = Annotated[Optional[str], field_option(TRAIN, "init_from")]
Trainable = Annotated[Optional[str], field_option(TRAIN, "trainable")]
Calibrate = Annotated[Optional[bool], field_option(TRAIN, "calibrate", "--calibrate/--no-calibrate")]
Objective = Annotated[Optional[str], field_option(TRAIN, "objective")]
Keep = Annotated[Optional[int], field_option(TRAIN, "keep")]
Parallel = Annotated[Optional[str], field_option(TRAIN, "parallel")]

# ----------------------------------------------------------------------------------------------- eval, generate

Batches = Annotated[Optional[int], field_option(EVAL, "batches")]
Tasks = Annotated[Optional[str], field_option(HARNESS, "tasks", help=(
    "lm-evaluation-harness tasks, groups or tags, comma-separated (e.g. arc_easy,hellaswag,piqa,winogrande,mmlu), "
    "or task YAML files: run them instead of the perplexity evaluation (needs pip install 'modcli[eval]')."))]
IncludePath = Annotated[Optional[str], field_option(HARNESS, "include_path")]
NumFewshot = Annotated[Optional[int], field_option(HARNESS, "num_fewshot")]
Limit = Annotated[Optional[int], field_option(HARNESS, "limit")]
Prompts = Annotated[Optional[list[str]], field_option(GENERATE, "prompts", "--prompt")]
MaxNewTokens = Annotated[Optional[int], field_option(GENERATE, "max_new_tokens")]
Temperature = Annotated[Optional[float], field_option(GENERATE, "temperature")]
TopK = Annotated[Optional[int], field_option(GENERATE, "top_k")]
TopP = Annotated[Optional[float], field_option(GENERATE, "top_p")]
ExitThreshold = Annotated[Optional[float], field_option(GENERATE, "exit_threshold")]
Speculative = Annotated[Optional[int], field_option(GENERATE, "speculative")]
DraftTokens = Annotated[Optional[int], field_option(GENERATE, "draft_tokens")]

# ------------------------------------------------------------------------------------------------------- export

Graphs = Annotated[Optional[list[str]], field_option(EXPORT, "graphs", "--graph")]
Provider = Annotated[Optional[str], field_option(EXPORT, "provider")]
Opset = Annotated[Optional[int], field_option(EXPORT, "opset")]
OpsetOnly = Annotated[Optional[bool], field_option(EXPORT, "opset_only", "--opset-only")]
Atol = Annotated[Optional[float], field_option(EXPORT, "atol")]
DecodeSteps = Annotated[Optional[int], field_option(EXPORT, "decode_steps")]
Force = Annotated[Optional[bool], field_option(EXPORT, "force", "--force")]
HF = Annotated[Optional[bool], field_option(EXPORT, "hf", "--hf")]

# ------------------------------------------------------------------------------------------------------ profile

Compare = Annotated[Optional[str], field_option(PROFILE, "compare")]
SeqLens = Annotated[Optional[str], field_option(
    PROFILE, "seq_lens", help="Sequence lengths to profile, comma-separated (e.g. 256,512,1024,2048), instead of --seq-len.")]
Repeats = Annotated[Optional[int], field_option(PROFILE, "repeats")]
Measure = Annotated[Optional[str], field_option(PROFILE, "measure", help=(
    "Which measurements to run, comma-separated: forward, train, decode (decode includes the causal prefill); "
    "default all three."))]
DecodeTokens = Annotated[Optional[int], field_option(PROFILE, "decode_tokens")]
Backends = Annotated[Optional[str], field_option(PROFILE, "backends", help=(
    "Which paths to time, comma-separated, each against the baseline in the same interleaved run (default eager): "
    "eager (PyTorch as is), compiled (torch.compile: forward, training step, causal prefill, static-shape decode "
    "step; compile time reported apart), onnxruntime (both models exported to ONNX here: forward and decode step)."))]
Memory = Annotated[Optional[bool], field_option(PROFILE, "memory", "--memory/--no-memory")]
Plot = Annotated[Optional[str], field_option(PROFILE, "plot")]

# ------------------------------------------------------------------------------- import, routes, sweep, tokenizer

Source = Annotated[str, field_argument(IMPORT, "source")]
MaxTokens = Annotated[Optional[int], field_option(ROUTES, "max_tokens")]
Start = Annotated[Optional[int], field_option(ROUTES, "start")]
Grid = Annotated[Path, field_argument(SWEEP, "grid", help=(
    "Grid TOML: budgets, [[size]] and [[variant]] tables, [common] flags."))]
ProfileRuns = Annotated[Optional[bool], field_option(SWEEP, "profile", "--profile")]
DryRun = Annotated[Optional[bool], field_option(SWEEP, "dry_run", "--dry-run")]
ReportOnly = Annotated[Optional[bool], field_option(SWEEP, "report_only", "--report-only")]
Verbose = Annotated[Optional[bool], field_option(SWEEP, "verbose", "--verbose")]
MaxBytes = Annotated[Optional[int], field_option(TOKENIZER, "max_bytes")]

# --------------------------------------------------------------------------------- plot (no config of its own)

Runs = Annotated[list[str], typer.Argument(help="Run folders (of `modcli train` or a sweep's runs/).",
                                           show_default=False)]
Smooth = Annotated[int, typer.Option(help="Moving average of the training loss over N steps (1 = raw).")]
