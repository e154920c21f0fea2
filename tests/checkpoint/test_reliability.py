"""Reliability under faults and bad input, the guarantees listed in the README's "Guarantees" section.

Kills during checkpoint saves, failed writes, two runs into one folder, a diverging loss, damaged files and bad
corpora. Runs that must be killed are `modcli train` command lines in child processes forked from a forkserver
that has already imported torch, so twenty kills cost seconds, not minutes; everything else runs in-process
through typer's CliRunner.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from modcli.checkpoint.lock import OutLock, RunLock, out_lock_path, run_lock_path, sibling_lock_path
from modcli.checkpoint.store import SLOW_SAVE_ENV, complete_checkpoints, load_model_from, resolve_checkpoint
from modcli.cli import app
from modcli.errors import UserError
from modcli.training.loop import NAN_AT_STEP_ENV

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--batch-size", "2",
        "--eval-batches", "1", "--device", "cpu", "--warmup", "1", "--log-every", "1"]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def train_args(corpus: Path, out: Path, *extra: str, steps: int = 4, every: int = 1, keep: int = 2) -> list[str]:
    return ["train", "--data", str(corpus), "--out", str(out), "--max-steps", str(steps), "--eval-every", str(every),
            "--keep", str(keep), *TINY, *extra]


def assert_one_line_error(result, code: int, *fragments: str, at_start: bool = True) -> None:
    """Exit `code`, no traceback, and one line starting with "error:" holding every fragment: the only line on
    stderr for a refusal `at_start`, else the last, after the run's progress lines."""
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and lines[-1] == errors[0] and lines[-1].startswith("error: "), result.stderr
    assert len(lines) == 1 or not at_start, result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])


def same_weights(a: Path, b: Path) -> bool:
    got, want = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return got.keys() == want.keys() and all(torch.allclose(got[k], want[k], atol=1e-5, rtol=0) for k in want)


def leftovers(run: Path) -> list[str]:
    """Everything in a run folder that is not a checkpoint, metrics.jsonl or TensorBoard's folder."""
    return sorted(p.name for p in run.iterdir()
                  if not re.match(r"^step-\d{8}$", p.name) and p.name not in ("metrics.jsonl", "tensorboard"))


# ----------------------------------------------------------------------------------------------- children


def _cli_child(argv: list[str], env: dict[str, str], log: str) -> None:
    """Runs `modcli ARGV` in a forkserver child, its stdout and stderr into `log`."""
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)  # these models are tiny: one thread is fastest, and the same as the parent's
    if "MODCLI_TEST_NO_TRANSFORMERS" in env:  # export --hf without loading the folder back (the check is slow)
        import importlib.util

        find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *args: None if name == "transformers" else find_spec(name, *args)
    if "MODCLI_TEST_FSIZE_LIMIT" in env:  # a real failed write: files may not grow past this many bytes
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(env["MODCLI_TEST_FSIZE_LIMIT"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    app(argv, prog_name="modcli")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, most of all on a busy machine; children use one too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def forkserver():
    context = multiprocessing.get_context("forkserver")
    # torch and modcli imported once, in the server; with what a training run imports lazily (a name that does
    # not exist in some torch version is skipped by the server)
    context.set_forkserver_preload([__name__, "torch._dynamo", "torch.onnx", "torch.nn.utils",
                                    "torch._functorch._aot_autograd", "modcli.models.routing.topk", "numpy.random"])
    return context


def start_child(forkserver, argv: list[str], log: Path, **env: str):
    env = {"MODCLI_CACHE": os.environ["MODCLI_CACHE"], "OMP_NUM_THREADS": "1", **env}
    process = forkserver.Process(target=_cli_child, args=(argv, env, str(log)))
    process.start()
    return process


# ----------------------------------------------------------------------------------------------- kill -9


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, corpus_file) -> Path:
    """The uninterrupted run every killed run is compared with; it keeps every checkpoint."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = CliRunner().invoke(app, train_args(corpus_file, out, keep=10))
    assert result.exit_code == 0, result.output
    return out


SAVE_STAGES = ("tmp", "model.safetensors", "optimizer.pt", "config.json", "state.json", "COMPLETE", "renamed",
               "pruning")
"""What a save has done, as a test sees it on disk (modcli.checkpoint.store.save_checkpoint pauses between them)."""
KILL_POINTS = [(1, stage) for stage in ("tmp", "model.safetensors", "optimizer.pt", "state.json", "COMPLETE")] + \
              [(2, stage) for stage in SAVE_STAGES[:7]] + [(3, stage) for stage in SAVE_STAGES]
"""20 moments: the first save (no checkpoint yet) while its folder is written, every stage of the second, and of
the third, which also prunes the first (--keep 2)."""


def save_stage(run: Path, step: int) -> str | None:
    """The furthest stage the save of `step` has reached, or None."""
    name = f"step-{step:08d}"
    if list(run.glob(".trash-*")) and step >= 3:
        return "pruning"
    if (run / name).is_dir():
        return "renamed"
    for tmp in run.glob(f".tmp-{name}-*"):
        try:
            present = {p.name for p in tmp.iterdir()} if tmp.is_dir() else set()
        except FileNotFoundError:  # the save renamed it between the glob and the listing: it is past these stages
            continue
        for stage in reversed(SAVE_STAGES[1:6]):
            if stage in present:
                return stage
        return "tmp"
    return None


@pytest.mark.slow
def test_a_kill_at_any_moment_of_a_save_leaves_a_loadable_checkpoint_and_resume_finishes(
        forkserver, reference_run, corpus_file, tmp_path, runner):
    assert len(KILL_POINTS) == 20
    hit = []
    for i, (step, stage) in enumerate(KILL_POINTS):
        out, log = tmp_path / f"kill-{i}", tmp_path / f"kill-{i}.log"
        if step == 1:
            args = train_args(corpus_file, out)
        else:  # start from the reference's earlier checkpoints, so that only the save of `step` is slowed down
            out.mkdir()
            for earlier in range(1, step):
                shutil.copytree(reference_run / f"step-{earlier:08d}", out / f"step-{earlier:08d}")
            args = ["train", "--out", str(out), "--resume", "--keep", "2"]
        process = start_child(forkserver, args, log, **{SLOW_SAVE_ENV: "0.05"})
        wanted = SAVE_STAGES.index(stage)
        deadline = time.time() + 60
        while True:
            seen = save_stage(out, step) if out.is_dir() else None
            if seen is not None and SAVE_STAGES.index(seen) >= wanted:
                break
            assert process.is_alive(), log.read_text()
            assert time.time() < deadline, f"the save of step {step} never reached {stage}"
            time.sleep(0.002)
        process.kill()  # SIGKILL
        process.join()
        hit.append(seen == stage)
        assert process.exitcode == -signal.SIGKILL

        # No temporary folder is taken for a checkpoint; the newest complete one loads and is the reference's.
        found = complete_checkpoints(out)
        assert all(re.match(r"^step-\d{8}$", p.name) for p in found)
        if found:
            newest = resolve_checkpoint(out)
            assert newest == found[-1]
            load_model_from(out)
            assert same_weights(newest, reference_run / newest.name), newest
        else:
            with pytest.raises(UserError):
                resolve_checkpoint(out)
        stale = [name for name in leftovers(out) if name.startswith((".tmp-", ".trash-", ".old-"))]

        # --resume (or a fresh start when the first save was killed) takes over the killed run's lock, cleans up
        # and finishes exactly as the uninterrupted run did.
        args = ["train", "--out", str(out), "--resume", "--keep", "2"] if found else train_args(corpus_file, out)
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "took over the stale lock of modcli train" in result.stderr
        for name in stale:
            assert f"removed the stale temporary folder {out / name}" in result.stderr, (name, result.stderr)
        assert leftovers(out) == []
        assert [p.name for p in complete_checkpoints(out)] == ["step-00000003", "step-00000004"]
        assert same_weights(out / "step-00000004", reference_run / "step-00000004")
    assert sum(hit) >= 10, f"only {sum(hit)} of 20 kills landed on their stage"


def test_stale_temporary_folders_are_cleaned_and_a_displaced_checkpoint_is_put_back(trained_run, tmp_path):
    from modcli.checkpoint.store import clean_stale

    newest = resolve_checkpoint(trained_run)
    run = tmp_path / "run"
    (run / ".tmp-step-00000040-123").mkdir(parents=True)
    shutil.copytree(newest, run / f".old-{newest.name}-123")  # killed between the two renames of a re-save
    (run / ".trash-step-00000010-123").mkdir()
    notes = clean_stale(run)
    assert len(notes) == 3 and any("restored" in note for note in notes)
    assert sorted(p.name for p in run.iterdir()) == [newest.name]
    load_model_from(run)


@pytest.mark.slow
def test_a_run_killed_with_its_lock_is_taken_over_and_a_live_one_refuses_a_second_run(
        forkserver, corpus_file, tmp_path, runner):
    out, log = tmp_path / "run", tmp_path / "first.log"
    first = start_child(forkserver, train_args(corpus_file, out, steps=3), log, **{SLOW_SAVE_ENV: "0.2"})
    deadline = time.time() + 60
    while not (complete_checkpoints(out) and list(out.glob(".tmp-step-*"))):  # saved once, saving again
        assert first.is_alive() and time.time() < deadline, log.read_text()
        time.sleep(0.01)
    lock = json.loads(out_lock_path(out).read_text())
    assert lock["pid"] == first.pid and lock["command"] == "train"
    assert not run_lock_path(out).exists()  # beside the run folder, not in it

    started = time.perf_counter()
    for args in (train_args(corpus_file, out, steps=3), ["train", "--out", str(out), "--resume"]):
        result = runner.invoke(app, args)
        assert_one_line_error(result, 2, f"--out {out} is in use by modcli train (pid {first.pid}")
    assert time.perf_counter() - started < 10  # refused at once, before any data or model is read
    assert first.is_alive()

    first.kill()
    first.join()
    result = runner.invoke(app, ["train", "--out", str(out), "--resume"])
    assert result.exit_code == 0, result.output
    assert f"took over the stale lock of modcli train (pid {first.pid}" in result.stderr
    assert not out_lock_path(out).exists()  # released on exit


def test_a_second_export_into_the_same_out_is_refused(trained_run, tmp_path, runner):
    out = tmp_path / "bundle"
    holder = RunLock(sibling_lock_path(out), "export", out)
    assert holder.acquire() is None
    try:
        result = runner.invoke(app, ["export", str(trained_run), "--out", str(out)])
        assert_one_line_error(result, 2, f"--out {out} is in use by modcli export (pid {os.getpid()}")
    finally:
        holder.release()
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path):
    path = sibling_lock_path(tmp_path / "bundle")
    path.write_text(json.dumps({"pid": 999999, "host": "gone", "command": "export", "started_unix": 1.5}))
    lock = RunLock(path, "export", tmp_path / "bundle")
    note = lock.acquire()
    assert note is not None and "took over the stale lock of modcli export (pid 999999 on gone" in note
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not path.exists()


# ----------------------------------------------------------------------------------------------- failed writes


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 662"),  # torch.save, disk full
])
def test_a_failed_save_keeps_the_previous_checkpoint_and_exits_1_with_one_line(
        failure, corpus_file, tmp_path, runner, monkeypatch):
    import modcli.checkpoint.store as checkpoint

    real_save = checkpoint.torch.save
    calls = {"n": 0}

    def save_that_fails_the_second_time(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            Path(path).write_bytes(b"half an optimizer")
            if isinstance(failure, OSError):
                failure.filename = str(path)
            raise failure
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save_that_fails_the_second_time)
    out = tmp_path / "run"
    result = runner.invoke(app, train_args(corpus_file, out, every=2))
    assert_one_line_error(result, 1, f"cannot write checkpoint {out / 'step-00000004'}",
                          f"the newest complete checkpoint, {out / 'step-00000002'}, is intact", at_start=False)
    if isinstance(failure, OSError):
        assert "No space left on device" in result.stderr
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000002"]
    load_model_from(out)
    assert leftovers(out) == []  # no temporary folder, no lock


@pytest.mark.slow
def test_a_real_write_failure_is_one_line_and_leaves_nothing(forkserver, corpus_file, tmp_path):
    """A file-size limit makes the OS refuse the write of model.safetensors (EFBIG), as a full disk would."""
    out, log = tmp_path / "run", tmp_path / "child.log"
    child = start_child(forkserver, train_args(corpus_file, out, steps=2, every=2), log,
                        MODCLI_TEST_FSIZE_LIMIT="50000")
    child.join(60)
    lines = [line for line in log.read_text().splitlines() if line.startswith("error")]
    assert child.exitcode == 1, log.read_text()
    assert len(lines) == 1 and f"cannot write checkpoint {out / 'step-00000002'}" in lines[0], log.read_text()
    assert "Traceback" not in log.read_text()
    assert complete_checkpoints(out) == [] and leftovers(out) == []


def test_a_failed_bundle_write_is_one_line_and_leaves_nothing(trained_run, tmp_path, runner, monkeypatch):
    import modcli.bundle.writer as export_bundle

    def disk_full(tmp, *args, **kwargs):
        (tmp / "forward.onnx").write_bytes(b"half a graph")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "forward.onnx"))

    monkeypatch.setattr(export_bundle, "_write_bundle", disk_full)
    out = tmp_path / "bundle"
    result = runner.invoke(app, ["export", str(trained_run), "--out", str(out)])
    assert_one_line_error(result, 1, f"cannot write the bundle {out}: No space left on device")
    assert list(tmp_path.iterdir()) == []  # no bundle, no temporary folder, no lock


def test_export_says_what_it_does_with_the_elapsed_seconds_and_json_stays_clean(
        trained_run, tmp_path, runner, monkeypatch):
    """Exporting the tiny preset takes minutes (the decode graph's torch.export most of it): every step is a line on
    stderr with the seconds since the start, a step still running says so every `heartbeat_s`; --json prints only
    its one object. The graph builders are replaced by instant fakes: this is about the lines, not the graphs."""
    import modcli.bundle.writer as export_bundle
    from modcli.bundle.validation import Check

    def slow_export_program(spec):
        time.sleep(0.05)
        return object()

    monkeypatch.setattr(export_bundle, "export_program", slow_export_program)
    monkeypatch.setattr(export_bundle, "export_onnx", lambda spec, program, path, opset: path.write_bytes(b"onnx"))
    monkeypatch.setattr(export_bundle, "fuse_graph", lambda path, heads, width: {})
    monkeypatch.setattr(export_bundle, "write_cache_writer", lambda path, dtype, opset: path.write_bytes(b"onnx"))
    monkeypatch.setattr(export_bundle, "onnx_summary", lambda path: ({}, [], []))
    monkeypatch.setattr(export_bundle, "validate_bundle",
                        lambda *args: [Check("forward", "cpu", "fake", 0.0, True, None, True)])
    monkeypatch.setattr(export_bundle.Progress, "heartbeat_s", 0.01)
    result = runner.invoke(app, ["export", str(trained_run), "--out", str(tmp_path / "bundle"), "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert all(re.match(r"^\[ *\d+\.\d s\] ", line) for line in lines), lines
    said = "\n".join(lines)
    for step in ("exporting the forward graph (topk routing): torch.export", "still exporting the forward graph",
                 "writing forward.onnx (ONNX opset 18)", "fusing attention in forward.onnx", "forward.onnx: ",
                 "exporting the decode graph (router routing): torch.export", "writing decode.onnx",
                 "validating the forward and decode graphs against eager PyTorch (onnxruntime cpu)",
                 "1 checks, 0 failed", f"publishing {tmp_path / 'bundle'}"):
        assert step in said, (step, said)
        said = said[said.index(step):]  # in this order
    assert re.search(r"took \d+\.\d s", result.stderr)

    result = runner.invoke(app, ["export", str(trained_run), "--out", str(tmp_path / "quiet"), "--provider", "cpu",
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and json.loads(result.stdout)["valid"] is True


# ----------------------------------------------------------------------------------------------- the atomic publish


def test_a_published_folder_replaces_the_old_one_whole_or_not_at_all(tmp_path, monkeypatch):
    """modcli.checkpoint.atomic, which checkpoints and bundles are written through."""
    import hashlib

    from modcli.checkpoint import atomic

    final = tmp_path / "folder"
    with atomic.publish_folder(final, marker="COMPLETE") as tmp:
        (tmp / "a.bin").write_bytes(b"first")
    marker = json.loads((final / "COMPLETE").read_text())
    assert marker == {"complete": True, "files": {"a.bin": {"sha256": hashlib.sha256(b"first").hexdigest(),
                                                            "bytes": 5}}}

    with pytest.raises(RuntimeError, match="killed"), atomic.publish_folder(final) as tmp:
        (tmp / "a.bin").write_bytes(b"half")
        raise RuntimeError("killed")
    assert (final / "a.bin").read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["folder"]

    real_replace = os.replace

    def fails_to_move_the_new_folder_in(source, target):
        if Path(source).name.startswith(".tmp-"):
            raise OSError(errno.EIO, "Input/output error", str(target))
        real_replace(source, target)

    monkeypatch.setattr(atomic.os, "replace", fails_to_move_the_new_folder_in)  # after the old one moved aside
    with pytest.raises(OSError, match="Input/output error"), atomic.publish_folder(final) as tmp:
        (tmp / "a.bin").write_bytes(b"second")
    monkeypatch.undo()
    assert (final / "a.bin").read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["folder"]

    with atomic.publish_folder(final) as tmp:
        (tmp / "a.bin").write_bytes(b"second")
    assert [p.name for p in final.iterdir()] == ["a.bin"] and (final / "a.bin").read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]


def test_what_a_killed_export_left_is_removed_and_a_displaced_bundle_is_put_back(tmp_path):
    from modcli.bundle.writer import export_lock

    out = tmp_path / "bundle"
    (tmp_path / ".tmp-bundle-123").mkdir()
    (tmp_path / ".old-bundle-123").mkdir()  # killed between the two renames of an export --force
    (tmp_path / ".old-bundle-123" / "manifest.json").write_text("{}")
    (tmp_path / ".tmp-other-123").mkdir()  # another bundle's: not this export's business
    notes: list[str] = []
    with export_lock(out, notes.append):  # what both exports run before anything else
        pass
    assert notes == [f"note: restored {out} from .old-bundle-123, left by an interrupted export --force",
                     f"note: removed the stale temporary folder {tmp_path / '.tmp-bundle-123'} (an interrupted "
                     "modcli command writing it)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-other-123", "bundle"]
    assert (out / "manifest.json").is_file()


# ----------------------------------------------------------------------------------------------- one rule for every --out


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> Path:
    """A tiny Hugging Face Llama folder for `modcli import` (made offline with transformers)."""
    pytest.importorskip("transformers")
    from tests.pretrained.test_pretrained import save_tiny_hf_model

    folder = tmp_path_factory.mktemp("hf-source") / "llama"
    save_tiny_hf_model("llama", folder)
    return folder


def beside(out: Path) -> list[str]:
    """What is in the folder holding `out`: OUT itself, and nothing a writer works in (`.tmp-`, `.old-`, a lock)."""
    return sorted(p.name for p in out.parent.iterdir())


def without_transformers(monkeypatch) -> None:
    """`export --hf` without loading the folder back in transformers (slow, and not what these tests are about)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformers" else find_spec(name, *args))


def test_every_writing_command_is_refused_while_another_holds_its_out(trained_run, corpus_file, tmp_path, runner):
    """The issue's two races (`export --hf` then `import`/`train` into the same --out) and every other pair: one lock
    per --out, whichever command holds it, refused at once with one line naming the holder; nothing written."""
    from tests.sweep.test_sweep import write_grid

    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    out = tmp_path / "out"
    commands = {
        "train": train_args(corpus_file, out),
        "import": ["import", str(trained_run), "--out", str(out)],
        "export": ["export", str(trained_run), "--out", str(out)],
        "export --hf": ["export", str(trained_run), "--hf", "--out", str(out)],
        "sweep": ["sweep", str(grid), "--out", str(out)],
        "tokenizer train": ["tokenizer", "train", "--data", str(corpus_file), "--out", str(out)],
    }
    for holder in ("export", "import", "train", "sweep"):
        with OutLock(out, holder, shared=holder == "sweep"):
            for name, args in commands.items():
                if name == holder == "sweep":
                    continue  # sweeps share a folder (below)
                result = runner.invoke(app, args)
                assert_one_line_error(result, 2, f"--out {out} is in use by modcli {holder} (pid {os.getpid()}")
                assert beside(out) == [".out.modcli.lock", "grid.toml"], (holder, name)
    assert beside(out) == ["grid.toml"]

    # A run still held by a modcli from before this rule (its lock inside the run folder) is refused too.
    out.mkdir()
    with RunLock(run_lock_path(out), "train", out):
        result = runner.invoke(app, ["export", str(trained_run), "--hf", "--out", str(out)])
        assert_one_line_error(result, 2, f"--out {out} is in use by modcli train (pid {os.getpid()}")


def test_sweeps_share_a_folder_that_no_other_command_may_write(tmp_path):
    out = tmp_path / "sweep"
    with OutLock(out, "sweep", shared=True), OutLock(out, "sweep", shared=True):
        with pytest.raises(UserError, match=r"is in use by modcli sweep"):
            OutLock(out, "train").acquire()
    with OutLock(out, "train"), pytest.raises(UserError, match=r"is in use by modcli train"):
        OutLock(out, "sweep", shared=True).acquire()
    assert list(tmp_path.iterdir()) == []


def test_publishing_never_replaces_a_folder_that_appeared_or_changed(tmp_path, monkeypatch):
    from modcli.checkpoint import atomic

    final = tmp_path / "folder"
    for plain_rename in (False, True):  # renameat2(RENAME_NOREPLACE), and the check-then-rename elsewhere
        if plain_rename:
            monkeypatch.setattr(atomic, "_renameat2_fn", None)
        # Nothing there when checked; an empty folder appears (a plain rename would replace it).
        with pytest.raises(atomic.FolderChanged, match="was created by another program after this command checked"), \
                atomic.publish_folder(final, expect=None) as tmp:
            (tmp / "a.bin").write_bytes(b"ours")
            final.mkdir()
        assert beside(final) == ["folder"] and list(final.iterdir()) == []
        # A folder checked, then changed.
        checked = atomic.folder_state(final)
        with pytest.raises(atomic.FolderChanged, match="was changed by another program"), \
                atomic.publish_folder(final, expect=checked) as tmp:
            (tmp / "a.bin").write_bytes(b"ours")
            (final / "theirs.txt").write_text("theirs")
        assert beside(final) == ["folder"] and [p.name for p in final.iterdir()] == ["theirs.txt"]
        # Unchanged since the check: replaced.
        with atomic.publish_folder(final, expect=atomic.folder_state(final)) as tmp:
            (tmp / "a.bin").write_bytes(b"ours")
        assert beside(final) == ["folder"] and [p.name for p in final.iterdir()] == ["a.bin"]
        shutil.rmtree(final)

    # A file (tokenizer train, and a coming export --gguf): the same rule.
    final = tmp_path / "tokenizer.json"
    with pytest.raises(atomic.FolderChanged, match="was created by another program"), \
            atomic.publish_file(final) as tmp:
        tmp.write_text("ours")
        final.write_text("theirs")
    assert final.read_text() == "theirs" and beside(final) == ["tokenizer.json"]
    with pytest.raises(atomic.FolderChanged, match="was changed by another program"), \
            atomic.publish_file(final, expect=atomic.folder_state(final)) as tmp:
        tmp.write_text("ours")
        final.write_text("theirs, edited")
    with atomic.publish_file(final, expect=atomic.folder_state(final)) as tmp:
        tmp.write_text("ours")
    assert final.read_text() == "ours" and beside(final) == ["tokenizer.json"]


@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
@pytest.mark.parametrize("kind", ["onnx", "hf"])
def test_an_export_never_replaces_what_appeared_at_its_out_after_the_check(
        kind, force, trained_run, tmp_path, runner, monkeypatch):
    import modcli.bundle.hf.writer as hf_writer
    import modcli.bundle.writer as onnx_writer

    out = tmp_path / "bundle"
    if force:  # an earlier export, which --force may replace, as it was when checked
        out.mkdir()
        (out / "manifest.json").write_text("{}")
        (out / "config.json").write_text(json.dumps({hf_writer.MARKER_KEY: {}}))
    before = snapshot(tmp_path)

    def another_program_writes_out(tmp, *args, **kwargs):
        (tmp / "model.safetensors").write_bytes(b"ours")
        out.mkdir(exist_ok=True)
        (out / "theirs.txt").write_text("theirs")

    if kind == "onnx":
        monkeypatch.setattr(onnx_writer, "_write_bundle", another_program_writes_out)
    else:
        monkeypatch.setattr(hf_writer, "_write_folder", another_program_writes_out)
        without_transformers(monkeypatch)
    args = ["export", str(trained_run), "--out", str(out)] + (["--hf"] if kind == "hf" else []) + \
        (["--force"] if force else [])
    result = runner.invoke(app, args)
    assert_one_line_error(result, 2, f"--out {out} was {'changed' if force else 'created'} by another program after "
                                     "this command checked it; it is left as it is and nothing was written there",
                          at_start=False)  # after the progress lines
    assert beside(out) == ["bundle"]  # no temporary folder, no lock
    assert snapshot(tmp_path) == {**before, "bundle/theirs.txt": snapshot(tmp_path)["bundle/theirs.txt"]}


def test_a_non_empty_folder_modcli_did_not_write_is_refused(trained_run, corpus_file, tmp_path, runner):
    """`import` into a folder holding the user's own tokenizer.json (the issue's case) and the same rule elsewhere."""
    from tests.sweep.test_sweep import write_grid

    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text('{"mine": true}')
    (mine / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    cases = [
        (["import", str(trained_run), "--out", str(mine)],
         f"--out {mine} is not empty (it holds notes.txt, tokenizer.json); import writes a new run folder"),
        (train_args(corpus_file, mine), f"--out {mine} is a non-empty folder that modcli train did not write (it "
                                        "holds notes.txt, tokenizer.json)"),
        (["sweep", str(grid), "--out", str(mine)], f"--out {mine} is a non-empty folder that is not a sweep's"),
        (["export", str(trained_run), "--out", str(mine), "--force"], "not a modcli bundle); refusing to delete it"),
        (["export", str(trained_run), "--hf", "--out", str(mine), "--force"], "refusing to delete it"),
        (["import", str(trained_run), "--out", str(trained_run)], "already holds checkpoints"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert_one_line_error(result, 2, message)
        assert snapshot(tmp_path) == before, args


@pytest.mark.parametrize("left", ["lock-only", "lock-and-partial-weights"])
def test_an_import_into_a_folder_a_killed_import_left_works(left, hf_source, tmp_path, runner):
    """An import killed before this rule left `RUN/.modcli.lock` (and its checkpoint's `.tmp-step-*` weights) inside
    the run folder: the next import removes them, says so, and writes a clean run."""
    out = tmp_path / "run"
    out.mkdir()
    run_lock_path(out).write_text(json.dumps({"pid": 999999, "host": "gone", "command": "import",
                                              "started_unix": 1.5}))
    if left == "lock-and-partial-weights":
        (out / ".tmp-step-00000000-999999").mkdir()
        (out / ".tmp-step-00000000-999999" / "model.safetensors").write_bytes(b"half the weights")
    result = runner.invoke(app, ["import", str(hf_source), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"removed {run_lock_path(out)}, the stale lock of modcli import (pid 999999 on gone" in result.stderr
    if left == "lock-and-partial-weights":
        assert f"removed the stale temporary folder {out / '.tmp-step-00000000-999999'}" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["step-00000000", "tokenizer.json"]
    assert beside(out) == ["run"]
    load_model_from(out)


IMPORT_STAGES = {
    # stage: what is on disk when the import is killed there (the run is written beside --out, then renamed)
    "run-folder": lambda tmp: True,
    "weights": lambda tmp: any((step / "model.safetensors").exists() for step in tmp.glob(".tmp-step-*")),
    "checkpoint": lambda tmp: (tmp / "step-00000000" / "COMPLETE").exists(),
}


@pytest.mark.slow
def test_a_killed_import_leaves_no_run_and_the_next_import_cleans_up(forkserver, hf_source, tmp_path, runner):
    reference = tmp_path / "reference"
    assert runner.invoke(app, ["import", str(hf_source), "--out", str(reference)]).exit_code == 0
    for i, (stage, reached) in enumerate(IMPORT_STAGES.items()):
        out, log = tmp_path / f"kill-{i}" / "run", tmp_path / f"kill-{i}.log"
        process = start_child(forkserver, ["import", str(hf_source), "--out", str(out)], log,
                              **{SLOW_SAVE_ENV: "0.2"})
        deadline = time.time() + 60
        while not any(reached(tmp) for tmp in out.parent.glob(".tmp-run-*")):
            assert process.is_alive() and time.time() < deadline, log.read_text()
            time.sleep(0.002)
        process.kill()
        process.join()
        assert not out.exists(), stage  # a killed import leaves no run folder, half or whole
        assert [name for name in beside(out) if name.startswith(".tmp-run-")], stage
        result = runner.invoke(app, ["import", str(hf_source), "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert "took over the stale lock of modcli import" in result.stderr
        assert "removed the stale temporary folder" in result.stderr
        assert beside(out) == ["run"]
        assert sorted(p.name for p in out.iterdir()) == ["step-00000000", "tokenizer.json"]
        assert same_weights(out / "step-00000000", reference / "step-00000000")


HF_STAGES = ("writing", "written", "displaced")
"""Moments of `export --hf`: its folder being written beside --out, written and about to be renamed, and (with
--force) the earlier export moved aside but the new one not yet in its place."""


@pytest.mark.slow
def test_a_killed_export_hf_leaves_nothing_and_a_displaced_folder_is_put_back(
        forkserver, trained_run, tmp_path, runner, monkeypatch):
    without_transformers(monkeypatch)
    for i, stage in enumerate(HF_STAGES):
        out, log = tmp_path / f"kill-{i}" / "hf", tmp_path / f"kill-{i}.log"
        args = ["export", str(trained_run), "--hf", "--out", str(out)]
        if stage == "displaced":
            assert runner.invoke(app, args).exit_code == 0
            earlier = snapshot(out)
            args.append("--force")
        process = start_child(forkserver, args, log, MODCLI_TEST_NO_TRANSFORMERS="1", **{SLOW_SAVE_ENV: "0.3"})
        deadline = time.time() + 60
        while True:
            tmps = list(out.parent.glob(".tmp-hf-*"))
            if stage == "writing" and tmps or stage == "written" and any((t / "README.md").exists() for t in tmps) \
                    or stage == "displaced" and list(out.parent.glob(".old-hf-*")):
                break
            assert process.is_alive() and time.time() < deadline, log.read_text()
            time.sleep(0.002)
        process.kill()
        process.join()
        if stage == "displaced":
            assert not out.exists()
            result = runner.invoke(app, args)  # puts the earlier export back, then replaces it (--force)
            assert result.exit_code == 0, result.output
            assert f"note: restored {out} from .old-hf-" in result.stderr
            assert snapshot(out).keys() == earlier.keys()
        else:
            assert not out.exists()
            result = runner.invoke(app, args)
            assert result.exit_code == 0, result.output
            assert "removed the stale temporary folder" in result.stderr
        assert "took over the stale lock of modcli export" in result.stderr
        assert beside(out) == ["hf"]
        assert json.loads((out / "config.json").read_text())["modcli_export"]["routing"]


def test_export_hf_on_a_full_disk_is_one_line_exit_1_and_leaves_nothing(trained_run, tmp_path, runner, monkeypatch):
    from safetensors import SafetensorError

    import modcli.bundle.hf.writer as hf_writer

    def disk_full(state, path, **kwargs):
        Path(path).write_bytes(b"half the weights")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf_writer, "save_file", disk_full)
    without_transformers(monkeypatch)
    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", str(trained_run), "--hf", "--out", str(out)])
    assert_one_line_error(result, 1, f"cannot write the folder {out}: Error while serializing: I/O error: No space "
                                     "left on device", at_start=False)  # after a progress line
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary folder, no lock


@pytest.mark.slow
def test_a_real_write_failure_of_export_hf_is_one_line_and_leaves_nothing(forkserver, trained_run, tmp_path):
    """A file-size limit makes the OS refuse the write of model.safetensors (EFBIG), as a full disk would."""
    out, log = tmp_path / "hf", tmp_path / "child.log"
    child = start_child(forkserver, ["export", str(trained_run), "--hf", "--out", str(out)], log,
                        MODCLI_TEST_FSIZE_LIMIT="50000", MODCLI_TEST_NO_TRANSFORMERS="1")
    child.join(60)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("error")]
    assert child.exitcode == 1, text
    assert len(lines) == 1 and f"cannot write the folder {out}: " in lines[0] and "File too large" in lines[0], text
    assert "Traceback" not in text
    assert beside(out) == ["child.log"]


def test_sweep_out_is_checked_as_every_other_out(corpus_file, tmp_path, runner, monkeypatch):
    from modcli.sweep.runner import check_sweep_folder
    from tests.sweep.test_sweep import write_grid

    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    real_open = os.open

    def read_only_file_system(path, *args, **kwargs):  # as a read-only mount answers (tests may run as root)
        if str(path).startswith(str(read_only)) and len(args) > 0 and args[0] & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_file_system)
    before = snapshot(tmp_path)
    for out, message in ((a_file, f"--out {a_file} is a file, not a sweep folder"),
                         (a_file / "sweep", f"--out {a_file / 'sweep'}: {a_file} is a file, not a folder"),
                         (read_only / "sweep", f"--out {read_only / 'sweep'}: cannot create "
                                               f"{read_only / '.sweep.modcli.lock'}: Read-only file system")):
        result = runner.invoke(app, ["sweep", str(grid), "--out", str(out)])
        assert_one_line_error(result, 2, message)
        assert snapshot(tmp_path) == before
    monkeypatch.undo()

    # A second sweep into a folder keeps its grid: the same grid (even reformatted) continues, another is refused.
    out = tmp_path / "sweep"
    out.mkdir()
    shutil.copyfile(grid, out / "grid.toml")
    reformatted = tmp_path / "same.toml"
    reformatted.write_text("# the same grid, commented\n" + grid.read_text())
    check_sweep_folder(out, reformatted, report_only=False)
    other = write_grid(tmp_path / "other.toml", corpus_file, budgets="[5e8]")
    result = runner.invoke(app, ["sweep", str(other), "--out", str(out)])
    assert_one_line_error(result, 2, f"--out {out} holds a sweep of another grid ({out / 'grid.toml'} differs from "
                                     f"{other}): pick another --out, or copy {other} over {out / 'grid.toml'}")
    assert (out / "grid.toml").read_text() == grid.read_text() and beside(out) == sorted(
        ["a-file", "grid.toml", "other.toml", "read-only", "same.toml", "sweep"])


def test_saved_files_get_the_permissions_of_the_umask(trained_run, tmp_path, runner, monkeypatch):
    """safetensors writes its files 0600; every file modcli publishes gets what the umask gives (0644 under 022)."""
    from tests.bundle.test_export import random_checkpoint

    without_transformers(monkeypatch)
    previous = os.umask(0o022)
    try:
        checkpoint = random_checkpoint(tmp_path / "run")
        assert runner.invoke(app, ["export", str(trained_run), "--hf", "--out", str(tmp_path / "hf")]).exit_code == 0
    finally:
        os.umask(previous)
    for path in (checkpoint / "model.safetensors", checkpoint / "COMPLETE", tmp_path / "hf" / "model.safetensors",
                 tmp_path / "hf" / "config.json"):
        assert oct(path.stat().st_mode & 0o777) == oct(0o644), path


# ----------------------------------------------------------------------------------------------- divergence


def test_a_nan_loss_stops_with_exit_3_naming_the_step_and_keeps_the_last_good_checkpoint(
        corpus_file, tmp_path, runner, monkeypatch):
    monkeypatch.setenv(NAN_AT_STEP_ENV, "3")
    out = tmp_path / "run"
    result = runner.invoke(app, train_args(corpus_file, out, every=2))
    assert_one_line_error(result, 3, "the loss became nan at step 3",
                          f"the last good checkpoint, {out / 'step-00000002'}, is kept", at_start=False)
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000002"]
    load_model_from(out)
    assert leftovers(out) == []


# ----------------------------------------------------------------------------------------------- damaged files


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _edit_config(checkpoint: Path, **model) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["model"].update(model)
    (checkpoint / "config.json").write_text(json.dumps(config))


DAMAGE = {
    # case: (what to do to the checkpoint, what the one line must say)
    "truncated-weights": (lambda c: _truncate(c / "model.safetensors"), "model.safetensors is damaged"),
    "bit-flipped-weights": (lambda c: _flip_last_byte(c / "model.safetensors"),
                            "model.safetensors is damaged: its sha256 differs"),
    "impossible-config": (lambda c: _edit_config(c, capacity=1.5), "config.json: --capacity must be in (0, 1]"),
    "config-of-wrong-type": (lambda c: _edit_config(c, d_model="wide"),
                             "config.json: model.d_model must be an integer, got 'wide'"),
    "absurd-config": (lambda c: _edit_config(c, n_layers=10**9),
                      "config.json describes a model of at least"),
    "missing-marker": (lambda c: (c / "COMPLETE").unlink(), "no complete checkpoint"),
    "another-shape": (lambda c: _edit_config(c, d_model=64), "(another model's weights?)"),
    "damaged-optimizer": (lambda c: _flip_last_byte(c / "optimizer.pt"), "optimizer.pt is damaged"),
    "damaged-state": (lambda c: (c / "state.json").write_text('{"step": 30, "tok'), "state.json is unreadable"),
}
RESUME_ONLY = ("damaged-optimizer", "damaged-state")


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def bundle(trained_run, tmp_path_factory) -> Path:
    from tests.bundle.test_export import exported_bundle

    return exported_bundle(trained_run, tmp_path_factory.mktemp("bundles"))


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_refused_by_every_command_with_one_line_and_nothing_written(
        case, trained_run, tmp_path, runner):
    run = tmp_path / "run"
    run.mkdir()
    newest = resolve_checkpoint(trained_run)
    shutil.copytree(newest, run / newest.name)
    damage, message = DAMAGE[case]
    damage(run / newest.name)
    commands = {
        "train --resume": ["train", "--out", str(run), "--resume"],
        "eval": ["eval", str(run), "--batches", "1", "--device", "cpu"],
        "generate": ["generate", str(run), "--max-new-tokens", "2", "--device", "cpu"],
        "profile": ["profile", str(run), "--compare", "none", "--repeats", "1", "--warmup", "0", "--measure",
                    "forward", "--no-memory", "--batch-size", "1", "--device", "cpu"],
        "export": ["export", str(run), "--out", str(tmp_path / "bundle")],
    }
    before = snapshot(tmp_path)
    for name, args in commands.items():
        if case in RESUME_ONLY and name != "train --resume":
            continue
        result = runner.invoke(app, args)
        assert_one_line_error(result, 2, message)
        assert str(run) in result.stderr, (name, result.stderr)  # the line names the file
        assert snapshot(tmp_path) == before, name  # nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def _run_cli(args: list[str], capsys) -> tuple[int, str]:
    from modcli_runtime.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("case", ["truncated-graph", "bit-flipped-graph", "edited-config", "missing-file",
                                  "missing-manifest", "impossible-manifest", "truncated-graph-unverified"])
def test_modcli_run_refuses_a_damaged_bundle_with_one_line(case, bundle, tmp_path, capsys):
    damaged = tmp_path / "bundle"
    shutil.copytree(bundle, damaged)
    args = [str(damaged), "--max-new-tokens", "2", "--temperature", "0"]
    expected = "does not match its sha256"
    if case.startswith("truncated-graph"):
        _truncate(damaged / "decode.onnx")
        if case.endswith("unverified"):
            args.append("--no-verify")
            expected = "onnxruntime cannot load decode.onnx"
    elif case == "bit-flipped-graph":
        _flip_last_byte(damaged / "forward.onnx")
    elif case == "edited-config":
        (damaged / "config.json").write_text((damaged / "config.json").read_text().replace("32", "33", 1))
    elif case == "missing-file":
        (damaged / "decode.onnx").unlink()
        expected = "decode.onnx is missing"
    elif case == "missing-manifest":
        (damaged / "manifest.json").unlink()
        expected = "not a modcli export bundle (no manifest.json)"
    elif case == "impossible-manifest":
        manifest = json.loads((damaged / "manifest.json").read_text())
        manifest["model"]["vocab_size"] = -1
        (damaged / "manifest.json").write_text(json.dumps(manifest))
        expected = "model.vocab_size and model.seq_len must be positive integers"
    before = snapshot(tmp_path)
    code, stderr = _run_cli(args, capsys)
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], stderr
    assert str(damaged) in lines[0] or "decode.onnx" in lines[0]
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_modcli_run_bad_flags_are_one_line_and_exit_2(bundle, capsys):
    for args, expected in (([str(bundle), "--max-new-tokens", "many"], "invalid int value: 'many'"),
                           ([str(bundle), "--provider", "tpu"], "invalid choice: 'tpu'"),
                           ([str(bundle), "--temperature", "nan"], "--temperature must be a finite number"),
                           ([str(bundle), "--seed", "-1"], "--seed must be >= 0"),
                           ([str(bundle), "--max-new-tokens", str(10**15)], "--max-new-tokens must be in 1..")):
        code, stderr = _run_cli(args, capsys)
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], (args, stderr)


# ----------------------------------------------------------------------------------------------- bad corpora


CORPORA = {
    "empty": (lambda p: p.write_bytes(b""), "is empty"),
    "binary": (lambda p: p.write_bytes(bytes(range(256)) * 8), "is not text (a NUL byte at offset 0)"),
    "no-matching-files": (lambda p: p.mkdir(), "no files match"),
    "binary-files-only": (lambda p: (p.mkdir(), (p / "a.png").write_bytes(b"\x89PNG\0" * 100)),
                          "are all binary"),
    "shorter-than-a-window": (lambda p: p.write_text("def f(x):\n    return x\n"), "corpus too short"),
}


@pytest.mark.parametrize("case", CORPORA)
def test_a_bad_corpus_is_one_line_and_exit_2(case, tmp_path, runner):
    data = tmp_path / "corpus"
    make, message = CORPORA[case]
    make(data)
    out = tmp_path / "run"
    result = runner.invoke(app, train_args(data, out))
    assert_one_line_error(result, 2, "--data", message)
    assert not out.exists()  # the run folder made for the lock is removed again


def test_an_unreadable_corpus_is_a_user_error(tmp_path):
    from modcli.config import DataConfig
    from modcli.data.corpus import load_corpus

    data = tmp_path / "secret.txt"
    data.write_text("text " * 1000)
    data.chmod(0)
    as_root = os.geteuid() == 0
    if as_root:  # root reads anything: read as nobody instead
        os.seteuid(65534)
    try:
        with pytest.raises(UserError, match=r"--data: cannot read .*secret.txt: Permission denied"):
            load_corpus(DataConfig(data=str(data)), seq_len=16)
    finally:
        if as_root:
            os.seteuid(0)


def test_an_odd_length_bin_is_byte_tokens_and_trains(tmp_path, runner):
    """A .bin holds one byte per token (uint8), so any length is whole tokens: 4,097 bytes train like 4,096."""
    data = tmp_path / "tokens.bin"
    data.write_bytes(bytes(i % 251 for i in range(4097)))
    result = runner.invoke(app, train_args(data, tmp_path / "run", steps=1))
    assert result.exit_code == 0, result.output

