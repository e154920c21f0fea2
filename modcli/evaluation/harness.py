"""`modcli eval RUN --tasks ...`: lm-evaluation-harness tasks (ARC, HellaSwag, PIQA, WinoGrande, MMLU, or a folder of
one's own task YAML files) on a modcli run, under one causal routing mode.

lm-eval is an optional extra (`pip install 'modcli[eval]'`) and is imported only inside the functions of this module:
the adapter class, `ModcliLM`, derives from lm-eval's `TemplateLM`, so it is made (and registered with lm-eval as
`modcli`) on first use by `lm_eval_model()`. Its three request types follow lm-eval's Hugging Face model
(`lm_eval.models.huggingface.HFLM`), with the model's forward pass under a causal routing mode:

- loglikelihood(context, continuation): the log-probability of the continuation's tokens after the context's, and
  whether greedy decoding would give them; context + continuation longer than the model's window (its training
  `seq_len`) lose tokens from the left. Requests are sorted by length and right-padded into batches; padding comes
  after each row's tokens, is never routed (`lengths`) and cannot reach earlier positions (causal attention).
- loglikelihood_rolling(text): the whole text's log-probability in disjoint windows of `seq_len` predicted tokens,
  the first conditioned on the prefix token, each later one on the tokens before it (lm-eval's
  `get_rolling_token_windows`, the rule of its HF model).
- generate_until(context, gen_kwargs): greedy decoding with the KV cache (`modcli.decode.generation.prefill`, then
  `decode_step`), the text cut at the first stop string; the context keeps its last `seq_len - max_gen_toks` tokens.
  It gives `modcli generate --temperature 0`'s tokens. Sampling is refused (its result would depend on the batch).

The routing mode is causal: each token's route is decided from itself and the tokens before it, as when decoding.
Full-sequence top-k ranks a token against later ones (it sees the future), so its scores are not a language model's
and it is refused. Text becomes tokens through the run's tokenizer, without special tokens (as the training corpus
was read); the prefix token that stands before a text with no context is the BOS a tokenizer.json adds, else its
`<|endoftext|>`, else the newline's token (for bytes: byte 10, which ends modcli's blank line between files).

`lm_eval --model modcli` needs the class registered first: lm-eval 0.4 finds models by name only in its own
registry (no entry-point plugins), so `python -m modcli.evaluation.harness ARGS` is lm-eval's command line with
`modcli` registered (`--model modcli --model_args path=RUN,routing=router`).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from modcli.checkpoint.store import load_model_from
from modcli.config import require
from modcli.data.tokenizer import JsonTokenizer, Tokenizer, load_tokenizer
from modcli.decode.generation import prefill
from modcli.decode.greedy import greedy_decode
from modcli.errors import UserError
from modcli.hardware import TORCH_DTYPES, autocast, resolve_device
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.packed_linear import PackedLinears, inference_linears

EXTRA = "pip install 'modcli[eval]'"
"""How to install lm-evaluation-harness with modcli."""
DEFAULT_MAX_GEN_TOKS = 256
"""New tokens of a generate_until request whose task names no max_gen_toks (lm-eval's default)."""
DEFAULT_BOOTSTRAP_ITERS = 100_000
"""Bootstrap resamples for the standard error of a metric without a closed form (lm-eval's default)."""


@dataclass
class HarnessConfig:
    """What `modcli eval --tasks` runs."""

    checkpoint: str
    """A run folder (its newest checkpoint) or one checkpoint folder."""
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks, groups or tags (arc_easy, hellaswag, piqa, winogrande, mmlu) or task YAML files,
    run instead of the perplexity evaluation (needs pip install 'modcli[eval]')."""
    include_path: str | None = None
    """A folder of task YAML files (and their data) to find --tasks in, before lm-eval's own tasks."""
    num_fewshot: int | None = None
    """Solved examples put before each question; None = each task's own number (0 where it names none)."""
    limit: int | None = None
    """Evaluate only the first N documents of each task (a quick check: a part's score is not the task's)."""
    routing: str | None = None
    """A causal mode of the model's router; None = its first causal mode (top-k sees the future and is refused)."""
    batch_size: int = 8
    """Requests per forward pass."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""
    dtype: str = "float32"
    """Autocast dtype."""
    packed_linears: bool | None = None
    """On the CPU in float32: nn.Linear through oneDNN's prepacked kernel (`modcli.packed_linear`); False = PyTorch's
    default BLAS; None = the CPU's default (`packed_linear.packed_by_default`: AMD)."""

    def __post_init__(self) -> None:
        require(bool(self.tasks) and all(task.strip() for task in self.tasks),
                "--tasks: name at least one task, comma-separated (e.g. arc_easy,hellaswag)")
        require(self.num_fewshot is None or self.num_fewshot >= 0, f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        require(self.limit is None or self.limit >= 1, f"--limit must be >= 1, got {self.limit}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(self.dtype in TORCH_DTYPES, f"--dtype must be one of {', '.join(TORCH_DTYPES)}, got {self.dtype!r}")
        self.tasks = [task.strip() for task in self.tasks]


@dataclass
class TaskResult:
    task: str
    """The task's (or group's) name as lm-eval reports it."""
    metrics: dict[str, float]
    """Metric -> value, as lm-eval computed it ("acc", "acc_norm", "word_perplexity", ...; a metric after a filter
    other than "none" is named "metric,filter")."""
    stderr: dict[str, float | None]
    """Metric -> its standard error (None where lm-eval computes none)."""
    higher_is_better: dict[str, bool]
    """Metric -> whether a higher value is better (accuracy) or a lower one (perplexity)."""
    samples: int | None
    """Documents evaluated (after --limit); None for a group."""
    num_fewshot: int | None
    """Few-shot examples per question; None for a group."""
    group: bool = False
    """An aggregate over the tasks of a group (e.g. mmlu over its 57 subjects)."""


@dataclass
class HarnessResult:
    checkpoint: str
    step: int
    kind: str
    """The model family in words (ModelConfig.kind)."""
    routing: str
    """The causal routing mode every request ran under."""
    lm_eval_version: str
    limit: int | None
    results: list[TaskResult]
    linear_kernel: str = "aten"
    """What nn.Linear ran with: onednn-packed (CPU float32, `modcli.packed_linear`) or aten (PyTorch's default)."""


# ---------------------------------------------------------------------------------------- the model's side


def window_inputs(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """The tokens a causal LM reads to score `continuation` after `context`: the two joined, less the last token,
    the first ones dropped when more than `max_length` remain (lm-eval's HF rule)."""
    return (context + continuation)[-(max_length + 1):][:-1]


@torch.no_grad()
def score_continuations(model: MoDDecoder, routing: str, requests: list[tuple[list[int], list[int]]], max_length: int,
                        batch_size: int, device: torch.device, dtype: str) -> list[tuple[float, bool]]:
    """(context tokens, continuation tokens) each -> (log-probability of the continuation, whether every continuation
    token is the argmax), in the order given. Longest first, `batch_size` rows per right-padded forward."""
    for context, continuation in requests:
        if not context or not continuation:
            raise ValueError("a loglikelihood request needs a context and a continuation token")
        if len(continuation) > max_length:
            raise UserError(f"a continuation of {len(continuation)} tokens does not fit the model's window of "
                            f"{max_length} tokens")
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0] + requests[i][1]))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        inputs = [window_inputs(*requests[i], max_length) for i in rows]
        lengths = torch.tensor([len(tokens) for tokens in inputs])  # (B,)
        tokens = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)  # (B, T) padding after each row
        for row, row_tokens in enumerate(inputs):
            tokens[row, :len(row_tokens)] = torch.tensor(row_tokens)
        with autocast(device, dtype):
            logits = model(tokens.to(device), routing, lengths=lengths.to(device))  # (B, T, V)
        for row, request in enumerate(rows):
            continuation = torch.tensor(requests[request][1], device=device)  # (C,)
            end = int(lengths[row])
            logprobs = logits[row, end - len(continuation):end].float().log_softmax(dim=-1)  # (C, V)
            picked = logprobs.gather(1, continuation[:, None])[:, 0]  # (C,)
            greedy = bool((logprobs.argmax(dim=-1) == continuation).all())
            results[request] = (float(picked.sum()), greedy)
    return results


@torch.no_grad()
def generate_greedy(model: MoDDecoder, routing: str, prompts: list[list[int]], max_new_tokens: int,
                    device: torch.device, dtype: str, finished: Callable[[list[int]], bool] | None = None,
                    linears: PackedLinears | None = None) -> list[list[int]]:
    """Greedy decoding with the KV cache for a batch of prompts (right-padded, one causal prefill, then one token a
    step in `modcli generate`'s loop, modcli.decode.greedy: `--temperature 0`'s tokens), -> each row's new tokens.
    `finished(new tokens)` (optional) says a row is done (its text holds a stop string); decoding ends when every row
    is, or after `max_new_tokens`. `linears`: the model's packed nn.Linear forward, for the prefill and (where B-row
    products pay) the decode steps."""
    linears = linears if linears is not None else PackedLinears(model, enabled=False)
    cache = DecoderCache.allocate(model.config, len(prompts), max(map(len, prompts)) + max_new_tokens, device,
                                  TORCH_DTYPES[dtype])
    with linears:
        logits = prefill(model, prompts, cache, routing, device, dtype)  # (B, V)
    new_tokens: list[list[int]] = [[] for _ in prompts]

    def emit(index: int, next_tokens: Tensor, logits: Tensor) -> bool:
        for row, token in enumerate(next_tokens.tolist()):
            new_tokens[row].append(token)
        return finished is not None and all(map(finished, new_tokens))

    def step(next_tokens: Tensor) -> Tensor:
        with autocast(device, dtype):
            return model.decode_step(next_tokens, cache, routing).float()

    with linears.up_to(len(prompts)):
        greedy_decode(logits, max_new_tokens, step, emit)
    return new_tokens


def holds_stop(tokenizer: Tokenizer, until: list[str]) -> Callable[[list[int]], bool] | None:
    """tokens -> whether their text holds one of the stop strings (None when there are none)."""
    if not until:
        return None

    def finished(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens)
        return any(stop in text for stop in until)

    return finished


def cut_at_stop(text: str, until: list[str]) -> str:
    """`text` up to the first place where one of the stop strings begins."""
    cuts = [text.find(stop) for stop in until if stop and stop in text]
    return text[:min(cuts)] if cuts else text


def prefix_token(tokenizer: Tokenizer) -> int:
    """The token before a text with no context: a tokenizer.json's BOS (what its post-processor puts first), else its
    <|endoftext|> (GPT-2 and Qwen end documents with it), else the newline's token (bytes: 10, the byte that ends the
    blank line modcli's corpus puts between files)."""
    if isinstance(tokenizer, JsonTokenizer):
        added = tokenizer.tokenizer.encode("", add_special_tokens=True).ids
        if added:
            return added[0]
        end_of_text = tokenizer.tokenizer.token_to_id("<|endoftext|>")
        if end_of_text is not None:
            return end_of_text
    newline = encode(tokenizer, "\n")
    if not newline:
        raise UserError(f"{tokenizer.name} has no BOS, <|endoftext|> or newline token to put before a text: give "
                        "lm-eval's --model_args prefix_token_id=N")
    return newline[-1]


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Text -> token ids without special tokens, as the training corpus was tokenised (modcli.data.corpus)."""
    if isinstance(tokenizer, JsonTokenizer):
        return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text)


def load_run(path: str, routing: str | None, device: torch.device) -> tuple[MoDDecoder, Tokenizer, str, Path]:
    """(model in eval mode, its tokenizer, the causal routing mode to use, the checkpoint folder)."""
    model, run_config, checkpoint = load_model_from(path, device)
    tokenizer = load_tokenizer(run_config.data.tokenizer, checkpoint.parent, model.config.vocab_size)
    routing = routing or (model.causal_modes() or ("dense",))[0]
    model.check_routing(routing, causal=True)  # top-k over the sequence sees the future: refused here
    return model, tokenizer, routing, checkpoint


# ----------------------------------------------------------------------------------------------- lm-eval's side


def import_lm_eval() -> None:
    """lm-eval, or a UserError naming the extra that installs it."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"--tasks needs lm-evaluation-harness, an optional extra: {EXTRA}") from None


@functools.cache
def lm_eval_model() -> type:
    """`ModcliLM`, lm-eval's model for modcli runs, registered with lm-eval as `modcli` (made once, on first use:
    it derives from lm-eval's TemplateLM and lm-eval is optional)."""
    import_lm_eval()
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    @register_model("modcli")
    class ModcliLM(TemplateLM):
        """A modcli run as an lm-eval model: `lm_eval --model modcli --model_args path=RUN[,routing=MODE]
        [,dtype=bfloat16][,packed_linears=True|False|auto]` (through `python -m modcli.evaluation.harness`), or
        ModcliLM(path=RUN) in Python."""

        def __init__(self, path: str, routing: str | None = None, device: str | None = None, dtype: str = "float32",
                     batch_size: int | str | None = 8, max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS,
                     prefix_token_id: int | str | None = None, packed_linears: bool | str | None = None,
                     **unused: Any) -> None:
            super().__init__()
            require(str(batch_size or 8).isdigit() and int(batch_size or 8) >= 1,
                    f"batch_size must be a whole number >= 1 for modcli runs, got {batch_size!r}")
            require(dtype in TORCH_DTYPES, f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
            # lm-eval's --model_args give strings; None or auto: the CPU's default (packed_linear.packed_by_default)
            packed = "auto" if packed_linears is None else str(packed_linears).lower()
            require(packed in ("true", "false", "auto"),
                    f"packed_linears must be True, False or auto, got {packed_linears!r}")
            self._device = resolve_device(device or "auto")
            self.model, self.run_tokenizer, self.routing, self.checkpoint = load_run(path, routing, self._device)
            self.dtype, self.batch_size, self.max_gen_toks = dtype, int(batch_size or 8), int(max_gen_toks)
            self.max_length = self.model.config.seq_len
            self._prefix = int(prefix_token_id) if prefix_token_id is not None else prefix_token(self.run_tokenizer)
            self.linears = inference_linears(self.model, self._device, dtype, {"true": True, "false": False}.get(packed))

        @property
        def eot_token_id(self) -> int:
            return self._prefix

        @property
        def tokenizer_name(self) -> str:
            return self.run_tokenizer.name

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return encode(self.run_tokenizer, string)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any):
            with self.linears:
                scores = score_continuations(self.model, self.routing, [(context, continuation)
                                                                        for _, context, continuation in requests],
                                             self.max_length, self.batch_size, self._device, self.dtype)
            for (request, _, _), score in zip(requests, scores, strict=True):
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, score)
            return scores

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            windows, owners = [], []
            for index, (text,) in enumerate(request.args for request in requests):
                for window in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=self.tok_encode(text), prefix_token=self._prefix, max_seq_len=self.max_length,
                        context_len=1)):
                    windows.append(window)
                    owners.append(index)
            with self.linears:
                scores = score_continuations(self.model, self.routing, windows, self.max_length, self.batch_size,
                                             self._device, self.dtype)
            totals = [0.0] * len(requests)
            for owner, (logprob, _) in zip(owners, scores, strict=True):
                totals[owner] += logprob
            for request, total in zip(requests, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            results: list[str] = [""] * len(requests)
            groups: dict[str, list[int]] = {}  # requests with the same generation settings decode as one batch
            for index, request in enumerate(requests):
                groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
            for indices in groups.values():
                settings = dict(requests[indices[0]].args[1])
                until = settings.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(settings.pop("max_gen_toks", self.max_gen_toks))
                if settings.get("do_sample") or float(settings.get("temperature") or 0) > 0:
                    raise UserError(f"task {requests[indices[0]].task_name} asks for sampling ({settings}); modcli's "
                                    "lm-eval model decodes greedily")
                room = self.max_length - max_new
                require(room > 0, f"task {requests[indices[0]].task_name}: {max_new} new tokens (max_gen_toks) leave no "
                                  f"room for a context in the model's window of {self.max_length} tokens")
                prompts = {i: self.tok_encode(requests[i].args[0])[-room:] or [self._prefix] for i in indices}
                order = sorted(indices, key=lambda i: -len(prompts[i]))
                for start in range(0, len(order), self.batch_size):
                    batch = order[start:start + self.batch_size]
                    outputs = generate_greedy(self.model, self.routing, [prompts[i] for i in batch], max_new,
                                              self._device, self.dtype, holds_stop(self.run_tokenizer, until),
                                              self.linears)
                    for i, tokens in zip(batch, outputs, strict=True):
                        results[i] = cut_at_stop(self.run_tokenizer.decode(tokens), until)
                        self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
            return results

        def get_model_info(self) -> dict[str, Any]:
            return {"model_checkpoint": str(self.checkpoint), "routing": self.routing, "kind": self.model.config.kind,
                    "seq_len": self.max_length, "linear_kernel": self.linears.kernel}

    return ModcliLM


def find_tasks(names: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager that knows every name in `names`, or a UserError naming the ones nobody knows. With an
    --include-path that holds them all, lm-eval's own ~15,000 tasks are not indexed (that takes seconds)."""
    from lm_eval.tasks import TaskManager

    def unknown(manager: TaskManager) -> list[str]:
        known = set(manager.all_tasks)
        return [name for name in names if name not in known and not _is_task_file(name)]

    if include_path is not None:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not unknown(manager):
            return manager
    manager = TaskManager(include_path=include_path)
    missing = unknown(manager)
    if missing:
        where = f", nor in --include-path {include_path}" if include_path else ""
        raise UserError(f"--tasks: unknown task {', '.join(missing)}: not among lm-eval's {len(manager.all_tasks):,} "
                        f"tasks, groups and tags{where} (`lm-eval ls tasks` lists them)")
    return manager


def _is_task_file(name: str) -> bool:
    return Path(name).suffix in (".yaml", ".yml") and Path(name).is_file()


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _data_missing(exc: BaseException) -> UserError:
    return UserError(f"--tasks: a task's data is not on this machine ({exc}): fetch it once with network access, "
                     "or point HF_HOME at a cache that holds it (docs/eval-harness.md)")


def task_file(manager: Any, name: str, specs: list[str]) -> str:
    """The YAML file a task (or group) came from, for a message: the file named in --tasks, or lm-eval's index."""
    for spec in specs:
        if spec == name and _is_task_file(spec):
            return spec
    entry = manager.task_index.get(name)
    if entry is not None and entry.yaml_path is not None:
        return str(entry.yaml_path)
    files = [spec for spec in specs if _is_task_file(spec)]
    return files[0] if len(files) == 1 else "a task file named in --tasks"


def load_tasks(manager: Any, specs: list[str]) -> dict[str, Any]:
    """lm-eval's `TaskManager.load(specs)`: {"tasks", "groups", "group_map"}. A task file lm-eval cannot load (a YAML
    parser error, a `!function` that names no function, a key of the wrong kind) is a UserError naming the task and
    its file: the task files are the user's input here."""
    try:
        return manager.load(specs)
    except (ConnectionError, FileNotFoundError) as exc:
        raise _data_missing(exc) from None
    except Exception as exc:
        culprit = specs[0]
        for spec in specs if len(specs) > 1 else ():  # which one: each alone (only when one has failed)
            try:
                manager.load([spec])
            except Exception:
                culprit = spec
                break
        raise UserError(f"--tasks {culprit}: lm-eval cannot load the task from {task_file(manager, culprit, specs)}: "
                        f"{_one_line(exc)}") from None


def check_few_shot(tasks: dict[str, Any], num_fewshot: int | None, file_of: Callable[[str], str]) -> None:
    """Each task's few-shot split holds the examples asked for (--num-fewshot, else the task's num_fewshot), plus
    the question itself where lm-eval draws examples from the split it evaluates; else a UserError (lm-eval's
    `ValueError: Sample larger than population`, raised once evaluation had begun)."""
    for name, task in tasks.items():
        shots = task.get_config("num_fewshot")
        if num_fewshot is not None and shots != 0:  # simple_evaluate's rule: a task's explicit 0 stays 0
            shots = num_fewshot
        if not shots:
            continue
        try:
            pool = len(task.fewshot_docs())
        except Exception:  # a task without a countable few-shot source: lm-eval will say
            continue
        split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
        same = split is not None and split == task.get_config("test_split")
        if pool < shots + same:
            given = f"--num-fewshot {shots}" if num_fewshot is not None else f"num_fewshot {shots} (the task's own)"
            raise UserError(f"{given}: task {name} ({file_of(name)}) has {pool} few-shot documents in its "
                            f"{split or 'few-shot'} split{', one of them the question itself' if same else ''}; "
                            f"ask for at most {pool - same}")


_MODCLI_SOURCES = str(Path(__file__).resolve().parents[1]) + os.sep


def _failing_task(exc: BaseException) -> str | None:
    """The lm-eval task whose own code raised `exc` (a frame of a Task method, with no modcli code below it), or
    None: then the failure is modcli's model or lm-eval's machinery, and keeps its traceback."""
    from lm_eval.api.task import Task

    name = None
    trace = exc.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        if frame.f_code.co_filename.startswith(_MODCLI_SOURCES):
            name = None  # modcli's code ran below the task: not the task's failure
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Task):
            name = candidate.get_config("task") or getattr(candidate, "task_name", None)
        trace = trace.tb_next
    return name


def evaluate_tasks(config: HarnessConfig) -> HarnessResult:
    """Run lm-eval's tasks on the run under its causal routing mode -> every task's metrics."""
    import_lm_eval()
    if config.include_path is not None and not Path(config.include_path).is_dir():
        raise UserError(f"--include-path {config.include_path}: no such folder")
    import lm_eval
    from lm_eval.evaluator import simple_evaluate

    model = lm_eval_model()(path=config.checkpoint, routing=config.routing, device=config.device, dtype=config.dtype,
                            batch_size=config.batch_size, packed_linears=config.packed_linears)
    manager = find_tasks(config.tasks, config.include_path)
    loaded = load_tasks(manager, config.tasks)
    check_few_shot(loaded["tasks"], config.num_fewshot, lambda task: task_file(manager, task, config.tasks))
    manager.load = lambda tasks: loaded  # simple_evaluate's own load: the tasks just checked, not built twice
    try:
        output = simple_evaluate(model=model, tasks=config.tasks,
                                 num_fewshot=config.num_fewshot, limit=config.limit, task_manager=manager,
                                 log_samples=False, bootstrap_iters=DEFAULT_BOOTSTRAP_ITERS)
    except (ConnectionError, FileNotFoundError) as exc:  # a dataset neither cached nor reachable (offline)
        raise _data_missing(exc) from None
    except Exception as exc:
        task = _failing_task(exc)
        if task is None:  # not in a task's own code (its templates, filters, sampler): modcli's or lm-eval's failure
            raise
        raise UserError(f"--tasks: task {task} ({task_file(manager, task, config.tasks)}) failed in lm-eval: "
                        f"{_one_line(exc)}") from None
    checkpoint = model.checkpoint
    step = int(checkpoint.name.split("-")[-1]) if checkpoint.name.startswith("step-") else 0
    return HarnessResult(str(checkpoint), step, model.model.config.kind, model.routing, lm_eval.__version__,
                         config.limit, task_results(output), model.linears.kernel)


def task_results(output: dict[str, Any]) -> list[TaskResult]:
    """lm-eval's results dict -> one TaskResult per task, then one per group."""
    found = []
    for section, group in (("results", False), ("groups", True)):
        for task, values in output.get(section, {}).items():
            metrics, stderr = {}, {}
            for key, value in values.items():  # "acc,none", "acc_stderr,none": metric and filter
                if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                    continue
                metric, filter_name = key.split(",", 1)
                name = metric if filter_name == "none" else key
                metrics[name] = float(value)
                error = values.get(f"{metric}_stderr,{filter_name}")  # "N/A" where lm-eval computes none
                stderr[name] = float(error) if isinstance(error, (int, float)) and math.isfinite(error) else None
            higher = output.get("higher_is_better", {}).get(task, {})
            found.append(TaskResult(
                task, metrics, stderr, {name: higher[name.split(",")[0]] for name in metrics if name.split(",")[0] in higher},
                None if group else output.get("n-samples", {}).get(task, {}).get("effective"),
                None if group else output.get("n-shot", {}).get(task), group))
    return found


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line, with modcli's model registered: `python -m modcli.evaluation.harness --model
    modcli --model_args path=RUN --tasks arc_easy`."""
    lm_eval_model()
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
