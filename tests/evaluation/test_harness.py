"""`modcli eval --tasks` through lm-evaluation-harness, on local tasks (tests/fixtures/lm_eval_tasks: JSON data and
task YAML, nothing downloaded). Every score is checked against an independent computation with the model's own
log-probabilities: one forward of the model, batch of one, under the causal routing mode."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modcli import packed_linear
from modcli.checkpoint.store import load_model_from, save_checkpoint
from modcli.cli import app
from modcli.config import ModelConfig
from modcli.models.decoder import MoDDecoder
from tests.conftest import on_cpu_of, packed_products, tiny_model_config, tiny_run_config

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-eval is not installed (pip install 'modcli[eval]')")
TASKS = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval_tasks"
ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _offline(tmp_path_factory):
    """No network: the local tasks build their data in memory; anything else lm-eval or datasets would write goes
    to a temporary folder."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in OFFLINE.items():
            patch.setenv(name, value)
        patch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
        yield


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory, corpus_file) -> Path:
    """The tiny MoD model trained until it writes the corpus' lines (200 steps: about 5 s), so that its answers
    differ from task to task and its generations reach the stop string."""
    from modcli.training.loop import train

    out = tmp_path_factory.mktemp("runs") / "learned"
    train(tiny_run_config(corpus_file, out, max_steps=200, eval_every=200, lr=1e-2), quiet=True)
    return out


def data(name: str) -> dict:
    return json.loads((TASKS / f"{name}.json").read_text())


def eval_tasks(run: Path, tasks: str, *extra: str):
    result = runner.invoke(app, ["eval", str(run), "--tasks", tasks, "--include-path", str(TASKS), "--device", "cpu",
                                 "--json", *extra])
    assert result.exit_code == 0, result.output
    return {task["task"]: task for task in json.loads(result.stdout)["results"]}, json.loads(result.stdout)


class Independent:
    """The scores from the model's own log-probabilities: one forward per window, batch of one."""

    def __init__(self, run: Path, routing: str) -> None:
        self.model = load_model_from(run, "cpu")[0]
        self.routing, self.window = routing, self.model.config.seq_len

    @torch.no_grad()
    def logprob(self, context: list[int], continuation: list[int]) -> float:
        """log p(continuation | context): the window of the model's context length that ends just before the
        continuation's last token (earlier tokens dropped), scored at its last len(continuation) positions."""
        inputs = (context + continuation)[-(self.window + 1):][:-1]
        logprobs = self.model(torch.tensor([inputs]), self.routing)[0].float().log_softmax(dim=-1)  # (T, V)
        targets = torch.tensor(continuation)
        return float(logprobs[-len(continuation):].gather(1, targets[:, None])[:, 0].sum())

    def rolling(self, tokens: list[int], prefix: int) -> float:
        """log p(text): chunks of `window` tokens, the first after the prefix token, each later one read in the
        window of `window` tokens that ends just before the chunk's last token."""
        total = 0.0
        for start in range(0, len(tokens), self.window):
            end = min(start + self.window, len(tokens))
            context = [prefix] if start == 0 else tokens[end - self.window - 1:start]
            total += self.logprob(context, tokens[start:end])
        return total


SHAPE = dict(d_model=32, n_layers=4, n_heads=4, seq_len=32)
FAMILIES = {
    "topk": lambda: tiny_model_config(), "threshold": lambda: tiny_model_config(router="threshold"),
    "attention": lambda: tiny_model_config(router="attention"), "moe": lambda: tiny_model_config(experts=4),
    "integrated MoDE": lambda: tiny_model_config(router="integrated", experts=4, noop_experts=2),
    "early exit": lambda: ModelConfig(**SHAPE, arch="early-exit"),
    "recursion": lambda: ModelConfig.of(**{**SHAPE, "n_layers": 5}, arch="recursion", recursions=3),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_scores_equal_the_models_own_in_every_family_and_causal_mode(family, tmp_path):
    """Right-padded batches of requests longer and shorter than the window, in each causal mode of each family."""
    from modcli.config import DataConfig, RunConfig, TrainConfig
    from modcli.evaluation.harness import generate_greedy, score_continuations
    from modcli.models.build import build_model

    torch.manual_seed(0)
    config = FAMILIES[family]()
    run = RunConfig(model=config, data=DataConfig(), train=TrainConfig(out=str(tmp_path)))
    save_checkpoint(tmp_path, 0, build_model(config), None, run, {"step": 0}, keep=1)
    generator = torch.Generator().manual_seed(1)
    requests = [(torch.randint(0, 256, (context,), generator=generator).tolist(),
                 torch.randint(0, 256, (continuation,), generator=generator).tolist())
                for context, continuation in [(5, 3), (30, 4), (12, 1), (40, 6), (2, 2)]]
    prompts = [context[-20:] for context, _ in requests]
    cpu = torch.device("cpu")
    for mode in load_model_from(tmp_path)[0].causal_modes() or ("dense",):
        model = Independent(tmp_path, mode)
        expected = [model.logprob(*request) for request in requests]
        for batch_size in (1, 3):
            scores = score_continuations(model.model, mode, requests, 32, batch_size, cpu, "float32")
            assert [logprob for logprob, _ in scores] == pytest.approx(expected, abs=1e-5)
        one_by_one = [generate_greedy(model.model, mode, [prompt], 6, cpu, "float32")[0] for prompt in prompts]
        assert generate_greedy(model.model, mode, prompts, 6, cpu, "float32") == one_by_one


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal values, as numpy's


@needs_lm_eval
@pytest.mark.parametrize("run", ["learned_run", "trained_dense_run"])
def test_multiple_choice_scores_equal_the_models_own_log_probabilities(run, request):
    run = request.getfixturevalue(run)
    tasks, output = eval_tasks(run, "modcli_tiny_choice", "--batch-size", "1", "--limit", "9")
    routing = output["routing"]
    assert routing == ("dense" if run.name.endswith("dense") else "router")  # the first causal mode, not topk
    score = tasks["modcli_tiny_choice"]
    assert score["samples"] == 9 and score["num_fewshot"] == 0

    model = Independent(run, routing)
    right = right_norm = 0
    docs = data("tiny_choice")["test"][:9]
    assert any(len(doc["question"]) > model.window for doc in docs)  # a context the window cuts from the left
    for doc in docs:
        context = list(doc["question"].encode())
        logprobs = [model.logprob(context, list(choice.encode())) for choice in doc["choices"]]
        right += argmax(logprobs) == doc["answer"]
        right_norm += argmax([lp / len(choice) for lp, choice in zip(logprobs, doc["choices"], strict=True)]) \
            == doc["answer"]
    assert score["metrics"] == {"acc": right / 9, "acc_norm": right_norm / 9}


@needs_lm_eval
def test_perplexity_task_equals_the_models_own_log_probabilities(learned_run):
    texts = [doc["text"] for doc in data("tiny_text")["test"]]
    model = Independent(learned_run, "router")
    assert max(map(len, texts)) > 2 * model.window  # scored in three windows
    logprobs = [model.rolling(list(text.encode()), prefix=ord("\n")) for text in texts]
    words = [len(re.split(r"\s+", text)) for text in texts]
    size = [len(text.encode()) for text in texts]
    expected = {"word_perplexity": math.exp(-sum(logprobs) / sum(words)),
                "byte_perplexity": math.exp(-sum(logprobs) / sum(size)),
                "bits_per_byte": -sum(logprobs) / sum(size) / math.log(2)}

    tasks, _ = eval_tasks(learned_run, "modcli_tiny_text", "--batch-size", "1")
    assert tasks["modcli_tiny_text"]["metrics"] == expected
    batched, _ = eval_tasks(learned_run, "modcli_tiny_text", "--batch-size", "4")  # right-padded rows
    for name, value in expected.items():
        assert batched["modcli_tiny_text"]["metrics"][name] == pytest.approx(value, rel=1e-5)


def samples(run: Path, task: str, **settings) -> list[dict]:
    """The per-document requests and answers lm-eval logged for `task` (the library, not the command line)."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from modcli.evaluation.harness import lm_eval_model

    lm = lm_eval_model()(path=str(run), device="cpu", batch_size=settings.pop("batch_size", 1))
    output = simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(TASKS),
                                                                              include_defaults=False),
                             log_samples=True, bootstrap_iters=0, **settings)
    return output["samples"][task]


@needs_lm_eval
def test_few_shot_contexts_are_scored_with_the_models_own_log_probabilities(learned_run):
    model = Independent(learned_run, "router")
    for batch_size in (1, 4):
        logged = samples(learned_run, "modcli_tiny_choice", num_fewshot=2, limit=4, batch_size=batch_size)
        assert len(logged) == 4
        for sample in logged:
            for (context, continuation), ((logprob, _),) in zip(sample["arguments"], sample["resps"], strict=True):
                assert context.count("\n\n") == 2  # two solved examples, then the question
                expected = model.logprob(list(context.encode()), list(continuation.encode()))
                if batch_size == 1:
                    assert logprob == expected
                else:  # rows padded to the batch's longest: the same numbers up to float rounding
                    assert logprob == pytest.approx(expected, abs=1e-4)


@needs_lm_eval
def test_generation_equals_modcli_generate_greedy(learned_run):
    logged = samples(learned_run, "modcli_tiny_generation", batch_size=4)
    assert len(logged) == 8
    room = 32 - 12  # the window less max_gen_toks: what is kept of each prompt
    contexts = [sample["arguments"][0][0] for sample in logged]
    assert any(len(context) > room for context in contexts)  # cut from the left
    prompts = [context[-room:] for context in contexts]
    args = ["generate", str(learned_run), "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu", "--json"]
    result = runner.invoke(app, [*args, *(arg for prompt in prompts for arg in ("--prompt", prompt))])
    assert result.exit_code == 0, result.output
    generated = json.loads(result.stdout)["texts"]
    stopped = [text for text in generated if "\n" in text]
    assert stopped and len(stopped) < len(generated)  # some rows reach the stop string, some run to max_gen_toks
    for sample, text in zip(logged, generated, strict=True):
        assert sample["resps"] == [[text.split("\n")[0]]]  # cut at the task's stop string


@needs_lm_eval
@pytest.mark.slow
def test_the_model_is_registered_with_lm_eval_and_its_command_line(learned_run):
    from lm_eval.api.registry import get_model

    from modcli.evaluation.harness import lm_eval_model

    assert get_model("modcli") is lm_eval_model()
    done = subprocess.run(
        [sys.executable, "-m", "modcli.evaluation.harness", "--model", "modcli", "--model_args",
         f"path={learned_run},routing=predictor", "--tasks", "modcli_tiny_choice", "--include_path", str(TASKS),
         "--limit", "3", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, **OFFLINE, "PYTHONPATH": f"{ROOT}:{ROOT / 'export'}"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "modcli_tiny_choice" in done.stdout and "acc" in done.stdout


@needs_lm_eval
@pytest.mark.skipif(not packed_linear.available(), reason="this PyTorch build has no oneDNN packed linear")
def test_every_request_kind_runs_the_packed_kernel_it_reports_and_scores_as_aten(learned_run, monkeypatch):
    """Loglikelihood (choice), rolling loglikelihood (text) and greedy generation (its prefill and every decode step)
    each go through oneDNN's packed linear by default on an AMD CPU (every product packed here: the tiny run's are
    too small to pay) and give aten's scores; --no-packed-linears computes no packed product."""
    on_cpu_of(monkeypatch, "AuthenticAMD")
    count = packed_products(monkeypatch)
    step_products: list[int] = []  # packed products per decode step
    decode_step = MoDDecoder.decode_step

    def counted_step(self, *args, **kwargs):
        before = count[0]
        logits = decode_step(self, *args, **kwargs)
        step_products.append(count[0] - before)
        return logits

    monkeypatch.setattr(MoDDecoder, "decode_step", counted_step)
    for task in ("modcli_tiny_choice", "modcli_tiny_text", "modcli_tiny_generation"):
        before = count[0]
        step_products.clear()
        packed, packed_output = eval_tasks(learned_run, task, "--batch-size", "4", "--limit", "6")
        assert packed_output["linear_kernel"] == "onednn-packed" and count[0] > before, task
        if task == "modcli_tiny_generation":
            assert step_products and min(step_products) > 0  # the decode steps too, not only the prefill
        after = count[0]
        aten, aten_output = eval_tasks(learned_run, task, "--batch-size", "4", "--limit", "6", "--no-packed-linears")
        assert aten_output["linear_kernel"] == "aten" and count[0] == after, task
        metrics = packed[task]["metrics"]
        assert metrics.keys() == aten[task]["metrics"].keys()
        for name, value in aten[task]["metrics"].items():  # rounding only: no choice, token or stop flips
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), (task, name)


@needs_lm_eval
def test_sampling_and_oversized_requests_are_refused(learned_run, monkeypatch):
    from lm_eval.api.instance import Instance

    from modcli.errors import UserError
    from modcli.evaluation.harness import lm_eval_model

    lm = lm_eval_model()(path=str(learned_run), device="cpu")
    sampled = Instance("generate_until", {}, ("def ", {"until": ["\n"], "do_sample": True, "temperature": 0.8}), 0)
    with pytest.raises(UserError, match="decodes greedily"):
        lm.generate_until([sampled])
    with pytest.raises(UserError, match="leave no room"):
        lm.generate_until([Instance("generate_until", {}, ("def ", {"max_gen_toks": 32}), 0)])
    with pytest.raises(UserError, match="does not fit the model's window of 32 tokens"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("def", " x" * 20), 0)])
    assert not [module for module in lm.linears.linears if "forward" in module.__dict__]  # restored after the error
    with pytest.raises(UserError, match="packed_linears must be True, False or auto, got 'maybe'"):
        lm_eval_model()(path=str(learned_run), device="cpu", packed_linears="maybe")
    if packed_linear.available():  # --model_args give strings, Python callers booleans; unset or auto: by CPU
        on_cpu_of(monkeypatch, "GenuineIntel")
        for given, kernel in (("False", "aten"), (False, "aten"), ("true", "onednn-packed"), (True, "onednn-packed"),
                              ("auto", "aten"), (None, "aten")):
            assert lm_eval_model()(path=str(learned_run), device="cpu", packed_linears=given).linears.kernel == kernel
        on_cpu_of(monkeypatch, "AuthenticAMD")
        assert lm_eval_model()(path=str(learned_run), device="cpu", packed_linears="auto").linears.kernel == (
            "onednn-packed")
    assert lm_eval_model()(path=str(learned_run), device="cpu", dtype="bfloat16").linears.kernel == "aten"


@needs_lm_eval
def test_bad_input_is_one_line_and_exit_2(learned_run, tmp_path):
    include = ["--include-path", str(TASKS)]
    for args, message in [
        (["--tasks", "modcli_tiny_choice", "--routing", "topk", *include], "topk is not causal"),
        (["--tasks", "modcli_tiny_choice", "--routing", "router", "--routing", "predictor", *include],
         "one causal --routing mode"),
        (["--tasks", "modcli_tiny_choice", "--include-path", str(tmp_path / "nowhere")], "no such folder"),
        (["--tasks", "modcli_tiny_choice", "--batches", "2", *include], "--batches applies to the perplexity"),
        (["--tasks", "", *include], "name at least one task"),
        (["--tasks", "modcli_tiny_choice", "--limit", "0", *include], "--limit must be >= 1"),
        (["--num-fewshot", "2"], "--num-fewshot applies to lm-evaluation-harness tasks"),
    ]:
        check_one_line(runner.invoke(app, ["eval", str(learned_run), "--device", "cpu", *args]), message)
    (tmp_path / "not-a-run").mkdir()
    result = runner.invoke(app, ["eval", str(tmp_path / "not-a-run"), "--tasks", "modcli_tiny_choice", *include])
    assert result.exit_code == 2 and "is not a modcli checkpoint or run folder" in result.stderr


@needs_lm_eval
@pytest.mark.slow
def test_an_unknown_task_and_data_not_on_this_machine_are_one_line_and_exit_2(learned_run):
    """A name neither in --include-path nor among lm-eval's own tasks (indexing those takes seconds), and a standard
    task whose data is not in the (empty) cache, offline."""
    import datasets

    assert datasets.config.HF_HUB_OFFLINE  # nothing can be downloaded here
    args = ["eval", str(learned_run), "--include-path", str(TASKS), "--device", "cpu", "--tasks"]
    check_one_line(runner.invoke(app, [*args, "modcli_tiny_choice,no_such_task"]),
                   "--tasks: unknown task no_such_task: not among lm-eval's")
    check_one_line(runner.invoke(app, [*args, "arc_easy"]), "--tasks: a task's data is not on this machine")


def check_one_line(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and message in lines[-1], result.stderr
    assert sum(line.startswith("error") for line in lines) == 1, result.stderr


def test_without_lm_eval_the_extra_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed: its import fails
    result = runner.invoke(app, ["eval", str(tmp_path), "--tasks", "modcli_tiny_choice"])
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: --tasks needs lm-evaluation-harness, an optional extra: pip install 'modcli[eval]'")


def json_tokenizer(path: Path, special: list[str], bos: str | None = None):
    """A small byte-level BPE tokenizer.json with these special tokens (and a post-processor that adds `bos`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from modcli.data.tokenizer import JsonTokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["def f(x):\n    return x\n"] * 4, trainers.BpeTrainer(
        vocab_size=280, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                                 special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(path))
    return JsonTokenizer(path)


def test_the_prefix_token_and_encoding_without_special_tokens(tmp_path):
    from modcli.data.tokenizer import ByteTokenizer
    from modcli.evaluation.harness import encode, prefix_token

    assert prefix_token(ByteTokenizer()) == 10 and encode(ByteTokenizer(), "é") == [0xC3, 0xA9]
    llama_like = json_tokenizer(tmp_path / "a.json", ["<unk>", "<s>", "</s>"], bos="<s>")
    assert prefix_token(llama_like) == llama_like.tokenizer.token_to_id("<s>") == 1
    assert llama_like.encode("def f")[0] == 1 and 1 not in encode(llama_like, "def f")  # no BOS in the text's tokens
    qwen_like = json_tokenizer(tmp_path / "b.json", ["<|endoftext|>", "<|im_start|>"])
    assert prefix_token(qwen_like) == qwen_like.tokenizer.token_to_id("<|endoftext|>") == 0
    plain = json_tokenizer(tmp_path / "c.json", [])
    assert prefix_token(plain) == plain.tokenizer.token_to_id("Ċ")  # the byte-level newline


@needs_lm_eval
def test_a_run_with_a_tokenizer_json_is_scored_in_its_own_tokens(tmp_path):
    """lm-eval splits context and continuation in the run's BPE tokens (the whole text encoded, the context's tokens
    taken off the front); each request's log-probability is the model's own for those tokens."""
    from modcli.config import DataConfig, RunConfig, TrainConfig
    from modcli.evaluation.harness import encode
    from modcli.models.build import build_model

    tokenizer = json_tokenizer(tmp_path / "tokenizer.json", ["<|endoftext|>"])
    config = tiny_model_config(vocab_size=280)
    run = RunConfig(model=config, data=DataConfig(tokenizer="tokenizer.json"), train=TrainConfig(out=str(tmp_path)))
    torch.manual_seed(0)
    save_checkpoint(tmp_path, 0, build_model(config), None, run, {"step": 0}, keep=1)

    model = Independent(tmp_path, "router")
    logged = samples(tmp_path, "modcli_tiny_choice", limit=6)
    assert len(logged) == 6
    for sample in logged:
        for (context, continuation), ((logprob, _),) in zip(sample["arguments"], sample["resps"], strict=True):
            context_tokens = encode(tokenizer, context)
            whole = encode(tokenizer, context + continuation)
            assert whole[:len(context_tokens)] == context_tokens and len(whole) < len(context + continuation)
            assert logprob == model.logprob(context_tokens, whole[len(context_tokens):])


@pytest.fixture(scope="module")
def random_run(tmp_path_factory) -> Path:
    """A tiny untrained run: enough for lm-eval to load tasks and score a few requests."""
    from modcli.config import DataConfig, RunConfig, TrainConfig
    from modcli.models.build import build_model

    out = tmp_path_factory.mktemp("runs") / "random"
    config = tiny_model_config()
    torch.manual_seed(0)
    save_checkpoint(out, 0, build_model(config), None,
                    RunConfig(model=config, data=DataConfig(), train=TrainConfig(out=str(out))), {"step": 0}, keep=1)
    return out


@needs_lm_eval
def test_broken_task_files_and_too_many_shots_are_one_line_naming_the_task_and_file(random_run, tmp_path,
                                                                                    monkeypatch):
    """A task YAML that does not parse, a `!function` that names no function (a YAML parser traceback and two chained
    tracebacks before) and --num-fewshot past the few-shot split (`ValueError: Sample larger than population` once
    evaluation had begun): one line naming the task and its file, exit 2."""
    import shutil

    from modcli.evaluation import harness

    folder = tmp_path / "tasks"
    shutil.copytree(TASKS, folder)
    (folder / "broken.yaml").write_text("task: broken\n  dataset_path: [\n")
    (folder / "nofunc.yaml").write_text((TASKS / "tiny_choice.yaml").read_text().replace(
        "data.choice", "data.nosuch").replace("modcli_tiny_choice", "modcli_nofunc"))
    base = ["eval", str(random_run), "--device", "cpu", "--include-path", str(folder), "--limit", "2"]
    for args, message in [
        (["--tasks", str(folder / "broken.yaml")],
         f"--tasks {folder / 'broken.yaml'}: lm-eval cannot load the task from {folder / 'broken.yaml'}: "
         "ScannerError: mapping values are not allowed in this context"),
        (["--tasks", str(folder / "nofunc.yaml")],
         f"lm-eval cannot load the task from {folder / 'nofunc.yaml'}: AttributeError: Module "),
        (["--tasks", f"modcli_tiny_choice,{folder / 'nofunc.yaml'}"], f"--tasks {folder / 'nofunc.yaml'}: lm-eval"),
        (["--tasks", "modcli_tiny_choice", "--num-fewshot", "9"],
         f"--num-fewshot 9: task modcli_tiny_choice ({folder / 'tiny_choice.yaml'}) has 8 few-shot documents in its "
         "train split; ask for at most 8"),
    ]:
        result = runner.invoke(app, [*base, *args])
        check_one_line(result, message)
        assert "Traceback" not in result.output
    assert "modcli_tiny_choice" in eval_tasks(random_run, "modcli_tiny_choice", "--num-fewshot", "8", "--limit",
                                              "1")[0]
    # an error raised in a task's own code during evaluation (here the sampler, its check bypassed): the same line
    monkeypatch.setattr(harness, "check_few_shot", lambda *args: None)
    check_one_line(runner.invoke(app, [*base, "--tasks", "modcli_tiny_choice", "--num-fewshot", "9"]),
                   f"--tasks: task modcli_tiny_choice ({folder / 'tiny_choice.yaml'}) failed in lm-eval: ValueError: "
                   "Sample larger than population")

    def broken_model(*args, **kwargs):
        raise RuntimeError("a bug in modcli's scoring")

    monkeypatch.setattr(harness, "score_continuations", broken_model)  # modcli's own failure keeps its traceback
    result = runner.invoke(app, [*base, "--tasks", "modcli_tiny_choice"])
    assert isinstance(result.exception, RuntimeError) and "a bug in modcli's scoring" in str(result.exception)


@needs_lm_eval
def test_bench_license_choice_items(tmp_path):
    """bench/tasks' local multiple-choice task: each item's right answer is the sentence after its two context
    sentences, the three others come from other texts (never from the item's own), and the build is deterministic;
    identical texts (GPL and its link GPL-3) count once."""
    spec = importlib.util.spec_from_file_location("bench_task_data", ROOT / "bench" / "tasks" / "data.py")
    data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(data)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    for index, name in enumerate(["A", "B", "C", "D"]):
        text = "".join(f"License {name} sentence {i} speaks of {words[(i + index) % 8]} and more words here. "
                       for i in range(12))
        (tmp_path / name).write_text(text)
    (tmp_path / "A-copy").write_text((tmp_path / "A").read_text())
    items = data.build_items(tmp_path, items=20, seed=3)
    assert len(items) == 20 and items == data.build_items(tmp_path, items=20, seed=3)
    assert {item["license"] for item in items} <= {"A", "B", "C", "D"}  # A-copy is A
    for item in items:
        sentences = data._sentences((tmp_path / item["license"]).read_text())
        where = sentences.index(item["context"].split(". ")[0] + ".")
        assert item["choices"][item["answer"]] == sentences[where + 2]
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        others = [c for i, c in enumerate(item["choices"]) if i != item["answer"]]
        assert all(f"License {item['license']} " not in choice for choice in others)
    (tmp_path / "B").unlink(), (tmp_path / "C").unlink(), (tmp_path / "D").unlink()
    with pytest.raises(FileNotFoundError, match="at least two"):
        data.build_items(tmp_path)
