"""Resume is all-or-nothing (issue #14): every malformed checkpoint is refused with one ``error:`` line and
exit 2 before the run folder changes; ``latest`` never leads outside its run; pruning and stale folders.

The malformed checkpoints are real ones from a tiny run (2 workers, checkpoints at steps 5 and 10),
edited: the safetensors file rewritten with a consistent checksum where the point is that a checksum
alone does not catch it (dtype, NaN, shape).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from noloco.train import checkpoint
from noloco.train.backends.local import launch as run
from noloco.train.cli import main
from noloco.train.metrics import read_metrics

COMMON = ("workers=2", "threads=1", "steps=15", "outer.every=5", "checkpoint.every=5", "checkpoint.keep=3",
          "log.tensorboard=false", "log.plot=false")  # fmt: skip
_PRISTINE: dict[str, Path] = {}


@pytest.fixture
def run_copy(tiny_config, tmp_path, tmp_path_factory) -> Path:
    """A copy (this test's to damage) of a real tiny run stopped after step 10, checkpoints at 5 and 10."""
    if "dir" not in _PRISTINE:  # kept outside the test's tmp_path, which goes when the test passes
        run(tiny_config(*COMMON, "run.name=pristine"), quiet=True, stop_after=10)
        _PRISTINE["dir"] = tmp_path_factory.mktemp("pristine") / "pristine"
        shutil.copytree(tmp_path / "pristine", _PRISTINE["dir"], symlinks=True)
    dest = tmp_path / "r"
    shutil.copytree(_PRISTINE["dir"], dest, symlinks=True)
    return dest


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file and link under ``folder`` with its content's hash (a link: its target)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _refused(capsys, run_dir: Path, *args: str, target: str | None = None, match: str = "") -> str:
    """Resume ``run_dir``'s latest (or ``target``): exit 2, one ``error:`` line, the folder unchanged."""
    before = _snapshot(run_dir)
    capsys.readouterr()
    code = main([f"resume={target or run_dir / 'checkpoints' / 'latest'}", "log.progress=false", *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]
    assert _snapshot(run_dir) == before, "a refused resume changed the run folder"
    return lines[0]


def _step10(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step_000010"


def _rewrite(folder: Path, rank: int, edit_tensors=None, edit_meta=None) -> None:
    """Rewrite worker ``rank``'s files with ``edit_tensors(tensors)`` / ``edit_meta(meta)`` applied and a
    checksum that matches the new safetensors file."""
    blob_path, meta_path = folder / f"worker_{rank}.safetensors", folder / f"worker_{rank}.json"
    meta = json.loads(meta_path.read_text())
    if edit_tensors is not None:
        tensors = load_file(blob_path)
        edit_tensors(tensors)
        save_file(tensors, blob_path)
    meta["sha256"] = checkpoint.file_checksum(blob_path, meta["sha256_part_bytes"])
    if edit_meta is not None:
        edit_meta(meta)
    meta_path.write_text(json.dumps(meta))


def test_a_valid_copy_resumes(run_copy, capsys):
    """The baseline for every refusal below: the undamaged copy resumes and finishes."""
    assert main([f"resume={run_copy}/checkpoints/latest", "log.progress=false"]) == 0
    assert max(r["step"] for r in read_metrics(run_copy)) == 15


# --------------------------------------------------------------------------- refused, folder untouched


def test_missing_worker_file_refused_before_the_healthy_workers_train(run_copy, capsys):
    (_step10(run_copy) / "worker_1.json").unlink()
    _refused(capsys, run_copy, match="no state for worker 1")
    assert not (run_copy / "checkpoints" / "step_000015").exists()


def test_extra_worker_refused(run_copy, capsys):
    """workers=1 on the command line would silently drop worker 1: refused."""
    _refused(capsys, run_copy, "workers=1", "outer.group_size=1", match="holds workers [0, 1]")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: p.write_text(p.read_text()[:100]), "not valid JSON"),
        (lambda p: p.write_text("[1, 2]"), "not an object"),
        (lambda p: p.write_bytes(b"\xff\xfe garbage"), "not valid JSON"),
        (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "not valid JSON"),
    ],
    ids=["truncated", "a-list", "not-utf8", "nested-100k-deep"],
)
def test_unreadable_json_refused(run_copy, capsys, damage, match):
    damage(_step10(run_copy) / "worker_0.json")
    _refused(capsys, run_copy, match=match)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(format="noloco-checkpoint-99"), "unknown checkpoint format"),
        (lambda m: m.update(step=5), "holds step 5"),
        (lambda m: m.update(rank=1), "holds worker 1"),
        (lambda m: m.update(sha256=7), "malformed 'sha256'"),
        (lambda m: m.pop("state"), "malformed 'state'"),
        (lambda m: m.update(state={"__tensor__": "no/such"}), "does not hold"),
        (lambda m: m.update(state={"__dict__": [["step", 10, "extra"]]}), "not a [key, value] pair"),
        (lambda m: m.update(state={"__dict__": [["step", {"x": 1, "y": 2}]]}), "malformed state"),
        (
            lambda m: m["state"].update(__dict__=[kv for kv in m["state"]["__dict__"] if kv[0] != "model"]),
            "state: missing ['model']",
        ),
    ],
    ids=["format", "step", "rank", "sha-type", "no-state", "dangling-tensor", "bad-pair", "bad-object", "no-model"],
)
def test_malformed_json_refused(run_copy, capsys, edit, match):
    _rewrite(_step10(run_copy), 0, edit_meta=edit)
    _refused(capsys, run_copy, match=match)


def _entry(meta: dict, *path):
    """The skeleton node at ``path`` (keys through __dict__ lists)."""
    node = meta["state"]
    for key in path:
        node = dict((k, v) for k, v in node["__dict__"])[key]
    return node


def _set_entry(meta: dict, value, *path) -> None:
    node = meta["state"]
    for key in path[:-1]:
        node = dict((k, v) for k, v in node["__dict__"])[key]
    node["__dict__"] = [[k, value if k == path[-1] else v] for k, v in node["__dict__"]]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: _set_entry(m, 7, "step"), "state is of step 7"),
        (lambda m: _set_entry(m, 3, "algorithm", "inner_step"), "at inner step 3"),
        (lambda m: _set_entry(m, {"__dict__": [["last_epoch", 4]]}, "schedule"), "schedule: not at step 10"),
        (lambda m: _set_entry(m, -1.0, "wall_seconds"), "wall_seconds"),
        (lambda m: _set_entry(m, [[1, "x"]], "eval_history"), "eval_history"),
        (lambda m: _set_entry(m, 4096, "vocab_size"), "vocabulary of 4096"),
        (
            lambda m: _set_entry(
                m, {"__dict__": [["__rebuilt__", "magic"], ["sha256", "0"]]}, "algorithm", "reference"
            ),
            "cannot rebuild",
        ),  # fmt: skip
        (
            lambda m: _set_entry(
                m, {"__dict__": [["__rebuilt__", "seed"], ["sha256", "0" * 64]]}, "algorithm", "reference"
            ),
            "not those of run.seed",
        ),  # fmt: skip
    ],
    ids=["step", "inner-step", "schedule", "wall", "history", "vocab", "rebuild-marker", "seed-digest"],
)
def test_inconsistent_state_refused(run_copy, capsys, edit, match):
    _rewrite(_step10(run_copy), 1, edit_meta=edit)
    _refused(capsys, run_copy, match=match)


def _plain_leaves(node, path: tuple = ()):
    """Every plain value (not a tensor reference) of a worker JSON, with its path: ("d", key) through a
    ``__dict__``, ("t", i) through a ``__tuple__``, ("l", i) through a list, ("o", key) through the top object."""
    if isinstance(node, dict) and "__dict__" in node:
        for key, value in node["__dict__"]:
            yield from _plain_leaves(value, (*path, ("d", key)))
    elif isinstance(node, dict) and "__tuple__" in node:
        for i, value in enumerate(node["__tuple__"]):
            yield from _plain_leaves(value, (*path, ("t", i)))
    elif isinstance(node, dict) and "__tensor__" not in node:
        for key, value in node.items():
            yield from _plain_leaves(value, (*path, ("o", key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _plain_leaves(value, (*path, ("l", i)))
    elif not isinstance(node, dict):
        yield path, node


def _set_leaf(node, path: tuple, value) -> None:
    *head, (kind, last) = path
    for step_kind, key in head:
        node = _child(node, step_kind, key)
    if kind == "d":
        node["__dict__"] = [[k, value if k == last else v] for k, v in node["__dict__"]]
    else:
        (node["__tuple__"] if kind == "t" else node)[last] = value


def _child(node, kind: str, key):
    if kind == "d":
        return dict((k, v) for k, v in node["__dict__"])[key]
    return node["__tuple__"][key] if kind == "t" else node[key]


def _hostile_values(value) -> list:
    """Values no field of that kind may hold: out of range, non-finite, or of another type."""
    if isinstance(value, bool) or value is None:
        return ["x", 1]
    if isinstance(value, float):
        return [float("nan"), -1.0, 1e300]
    if isinstance(value, int):
        return [-1, 10**30, "x"]
    return ["x", 7]


def _every_plain_field(folder: Path) -> list[tuple[str, tuple, object]]:
    meta = json.loads((folder / "worker_0.json").read_text())
    return [("/".join(str(k) for _, k in path), path, bad)
            for path, value in _plain_leaves(meta) for bad in _hostile_values(value)]  # fmt: skip


@pytest.mark.slow
def test_every_plain_field_of_a_worker_json_out_of_range_is_refused(run_copy, capsys):
    """Generated from the checkpoint itself: every plain value of a worker's JSON (metadata, optimizer settings
    and learning rates, LR schedule, counters, clocks, eval history, markers), set in turn to NaN, negative, huge or
    another type, is refused with one line, the run folder left byte-identical (issue #32: an lr of NaN, -1 or
    1e300 was trained with, or wrote files before a traceback)."""
    folder = _step10(run_copy)
    original = (folder / "worker_0.json").read_bytes()
    cases = _every_plain_field(folder)
    assert len(cases) > 150  # every field of the real file, not a hand-picked few
    refused: dict[str, str] = {}
    for name, path, bad in cases:
        _rewrite(folder, 0, edit_meta=lambda m, path=path, bad=bad: _set_leaf(m, path, bad))
        refused[f"{name}={bad!r}"] = _refused(capsys, run_copy)
        (folder / "worker_0.json").write_bytes(original)
    assert any("inner_opt/param_groups/0/lr" in line for line in refused.values())
    assert main([f"resume={run_copy}/checkpoints/latest", "log.progress=false"]) == 0  # restored: resumes


def test_changed_seed_refused(run_copy, capsys):
    """φ₀ is rebuilt from run.seed: resuming with another seed would silently change every round's φ − φ₀."""
    _refused(capsys, run_copy, "run.seed=1", match="not those of run.seed=1")


def test_damaged_tensors_refused(run_copy, capsys):
    blob = _step10(run_copy) / "worker_0.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    _refused(capsys, run_copy, match="checksum")


def test_garbage_safetensors_with_a_valid_checksum_refused(run_copy, capsys):
    blob = _step10(run_copy) / "worker_0.safetensors"
    blob.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}   ")
    _rewrite(_step10(run_copy), 0)
    _refused(capsys, run_copy, match="not a safetensors file")


def _key(folder: Path, prefix: str) -> str:
    return next(k for k in load_file(folder / "worker_0.safetensors") if k.startswith(prefix))


@pytest.mark.parametrize(
    "prefix, change, match",
    [
        ("algorithm/slow", lambda t: t.double(), "dtype float64, expected float32"),
        ("inner_opt/state/0/exp_avg_sq", lambda t: t.half(), "dtype float16, expected float32"),
        ("algorithm/rule/velocity", lambda t: t.to(torch.bfloat16), "dtype bfloat16"),
        ("algorithm/slow", lambda t: t.index_fill(0, torch.tensor([3]), float("nan")), "NaN or Inf"),
        ("inner_opt/state/2/exp_avg", lambda t: t.fill_(float("inf")), "NaN or Inf"),
        ("algorithm/feedback/contribution", lambda t: t[:-1].clone(), "shape"),
        ("inner_opt/state/1/exp_avg", lambda t: t.reshape(-1).clone(), "shape"),
    ],
    ids=["slow-fp64", "adam-fp16", "momentum-bf16", "slow-nan", "adam-inf", "residual-short", "adam-flat"],
)
def test_checksum_valid_tensor_of_the_wrong_kind_refused(run_copy, capsys, prefix, change, match):
    folder = _step10(run_copy)
    key = _key(folder, prefix)

    def edit(tensors):
        tensors[key] = change(tensors[key]).contiguous()

    _rewrite(folder, 0, edit_tensors=edit)
    _refused(capsys, run_copy, match=match)


def test_unreferenced_tensor_refused(run_copy, capsys):
    _rewrite(_step10(run_copy), 1, edit_tensors=lambda t: t.update(smuggled=torch.zeros(3)))
    _refused(capsys, run_copy, match="does not reference")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda f: (f / "COMPLETE").write_text("ten"), "not a step number"),
        (lambda f: (f / "COMPLETE").write_text("5"), "says step 5"),
        (lambda f: (f / "COMPLETE").unlink(), "incomplete"),
        (lambda f: (f / "config.yaml").unlink(), "config.yaml: missing"),
        (lambda f: (f / "config.yaml").write_text("steps: [unclosed"), "cannot parse"),
    ],
    ids=["complete-garbage", "complete-other-step", "no-complete", "no-config", "config-garbage"],
)
def test_damaged_folder_refused(run_copy, capsys, damage, match):
    damage(_step10(run_copy))
    _refused(capsys, run_copy, match=match)


# ------------------------------------------------------------------------------ latest stays in its run


def test_latest_pointing_into_another_run_is_not_followed(run_copy, tmp_path, capsys):
    """A ``latest`` that leads into another run would resume *that* run's state and then write into and prune
    its folder: refused, and both runs stay as they were."""
    other = tmp_path / "other"
    shutil.copytree(run_copy, other, symlinks=True)
    latest = run_copy / "checkpoints" / "latest"
    for target in ("../../other/checkpoints/step_000010", str(other / "checkpoints" / "step_000010"),
                   "./step_000010", "step_000010/../step_000005"):  # fmt: skip
        latest.unlink()
        latest.symlink_to(target)
        theirs = _snapshot(other)
        _refused(capsys, run_copy, match="refusing to follow it")
        assert _snapshot(other) == theirs


def test_checkpoints_folder_that_is_a_link_into_another_run_is_refused(run_copy, tmp_path, capsys):
    """Every link on the way is resolved, not only ``latest``: a ``checkpoints/`` that leads into another run
    would resume that run and write into and prune it."""
    other = tmp_path / "other"
    shutil.copytree(run_copy, other, symlinks=True)
    shutil.rmtree(run_copy / "checkpoints")
    (run_copy / "checkpoints").symlink_to(other / "checkpoints")
    theirs = _snapshot(other)
    _refused(capsys, run_copy, match="outside its run")
    _refused(capsys, run_copy, target=str(run_copy / "checkpoints" / "step_000010"), match="outside its run")
    assert _snapshot(other) == theirs


def test_step_folder_that_is_a_link_is_refused(run_copy, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(run_copy, other, symlinks=True)
    link = run_copy / "checkpoints" / "step_000020"
    link.symlink_to(other / "checkpoints" / "step_000010")
    _refused(capsys, run_copy, target=str(link), match="refusing to follow it")


def test_latest_that_is_not_a_link_or_a_folder_elsewhere_is_refused(run_copy, tmp_path, capsys):
    latest = run_copy / "checkpoints" / "latest"
    latest.unlink()
    latest.mkdir()
    _refused(capsys, run_copy, match="not a link")
    stray = tmp_path / "step_000010"
    shutil.copytree(_step10(run_copy), stray)
    _refused(capsys, run_copy, target=str(stray), match="not a checkpoint folder")


# ------------------------------------------------------------------------------------------- pruning


def _folder(root: Path, step: int, complete: bool) -> Path:
    folder = checkpoint.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "worker_0.json").write_text("{}")
    if complete:
        (folder / checkpoint.COMPLETE).write_text(str(step))
    return folder


def test_pruning_removes_complete_first_so_a_kill_mid_prune_leaves_it_incomplete(tmp_path, monkeypatch):
    for step in (5, 10):
        _folder(tmp_path, step, complete=True)
    _folder(tmp_path, 15, complete=False)
    killed = lambda *a, **k: None  # noqa: E731 - the process died before rmtree did anything
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    checkpoint.mark_complete(tmp_path, 15, "steps: 20\n", keep=2)
    old = checkpoint.step_dir(tmp_path, 5)
    assert old.exists() and not (old / checkpoint.COMPLETE).exists()  # incomplete: never resumed from
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.resolve(old)
    monkeypatch.undo()
    _folder(tmp_path, 20, complete=False)
    checkpoint.mark_complete(tmp_path, 20, "steps: 30\n", keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000015", "step_000020"]


def test_stale_incomplete_folders_and_temporary_files_are_cleaned_at_the_next_save(tmp_path):
    _folder(tmp_path, 5, complete=True)
    stale = _folder(tmp_path, 8, complete=False)  # a kill mid-save
    newer = _folder(tmp_path, 30, complete=False)  # an earlier attempt got further: rewritten when reached
    current = _folder(tmp_path, 10, complete=False)
    (current / ".worker_1.safetensors.999.abc.tmp").write_bytes(b"x" * 100)  # a killed writer's temp file
    (tmp_path / "checkpoints" / ".latest.999.link.tmp").symlink_to("step_000005")
    checkpoint.mark_complete(tmp_path, 10, "steps: 40\n", keep=2)
    assert not stale.exists() and newer.exists()
    assert not list(current.glob(".*")) and not list((tmp_path / "checkpoints").glob(".latest*"))
    assert checkpoint.resolve(tmp_path / "checkpoints" / "latest")[2] == 10
    assert (checkpoint.step_dir(tmp_path, 5) / checkpoint.COMPLETE).exists()  # keep=2


def test_old_format_checkpoints_still_load(tmp_path):
    """Format 1 stored every tensor (φ₀ and θ included): still accepted."""
    state = {"step": 3, "model": {"w": torch.ones(2)}, "x": None}
    checkpoint.save_worker(tmp_path, 3, 0, state)
    meta_path = checkpoint.step_dir(tmp_path, 3) / "worker_0.json"
    meta = json.loads(meta_path.read_text())
    meta["format"] = "noloco-checkpoint-1"  # and its checksum: the plain SHA-256 of the file
    meta["sha256"] = hashlib.sha256(meta_path.with_suffix(".safetensors").read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))
    assert torch.equal(checkpoint.load_worker(meta_path.parent, 0, 3)["model"]["w"], torch.ones(2))
