"""Files and names from outside (issue #32): every number read from a file is bounded before it is used, every
failure a user or a file can cause is one ``error:`` line and exit 2, and names stay single folder names.

Each case is a real file or a real process: the CLI (``train.py``'s ``main``, ``python -m noloco.export`` /
``noloco.sample``) run on it, its exit status and stderr read, the folders it may touch compared before and
after.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from noloco.train.cli import main


def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _one_error_line(err: str, match: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("warning:", "note:"))]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("key", ["run.name", "peer.run_id", "peer.name"])
@pytest.mark.parametrize("name", ["../x", "../../x", "/tmp/noloco-absolute-name", "a/../../x", "..", "."])
def test_a_name_that_is_not_a_single_folder_name_is_refused(tmp_path, capsys, key, name):
    """``run.name=../x`` wrote outside ``run.dir``; ``peer.run_id`` and ``peer.name`` name folders too."""
    root = tmp_path / "root"
    (root / "runs").mkdir(parents=True)
    before = _snapshot(root)
    code = main([f"run.dir={root / 'runs'}", f"{key}={name}", "steps=2", "log.progress=false"])
    assert code == 2
    _one_error_line(capsys.readouterr().err, f"{key}=")
    assert _snapshot(root) == before
    assert not Path("/tmp/noloco-absolute-name").exists()


TINY = ("workers=2", "threads=1", "steps=10", "outer.every=5", "checkpoint.every=5", "log.tensorboard=false",
        "log.plot=false")  # fmt: skip


def test_a_run_killed_between_its_last_checkpoint_and_its_summary_gets_the_summary_on_resume(
    smoke_overrides, data_cache, tmp_path, capsys
):
    """The last checkpoint holds everything the summary needs: resuming it writes ``summary.json`` (the same
    final losses, bytes and rejections) instead of asking for more steps; once written, a resume is refused."""
    common = [*smoke_overrides, f"data.cache_dir={data_cache}", f"run.dir={tmp_path}", "run.name=r", *TINY]
    assert main(common) == 0
    run_dir = tmp_path / "r"
    complete = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()  # what a kill after the final checkpoint leaves
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main([f"resume={run_dir}/checkpoints/latest", "log.progress=false"]) == 0
    assert "summary.json is missing: writing the summary" in capsys.readouterr().err
    again = json.loads((run_dir / "summary.json").read_text())
    for key in ("final_eval_loss_per_worker", "bytes_sent_by_worker", "bytes_received_by_worker", "steps",
                "norm_rejections_by_worker", "consensus_distance", "unigram_eval_loss"):  # fmt: skip
        assert again[key] == complete[key], key
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics  # no step trained twice, nothing cut
    assert main([f"resume={run_dir}/checkpoints/latest", "log.progress=false"]) == 2
    _one_error_line(capsys.readouterr().err, "raise steps= to continue")


# ------------------------------------------------------------------------------- sizes read from files

ROOT = Path(__file__).resolve().parents[2]
REFUSAL_FIGURES: dict[str, tuple[float, float, float]] = {}  # case → (seconds, peak RSS MB, above the baseline)


_HIGH_WATER = (
    "import atexit, os, runpy, sys\n"
    "def peak():\n"
    "    with open('/proc/self/status') as f, open(os.environ['NOLOCO_TEST_HWM'], 'w') as out:\n"
    "        out.write(next(l for l in f if l.startswith('VmHWM')).split()[1])\n"
    "atexit.register(peak)\n"
    "target, sys.argv = sys.argv[1], sys.argv[1:]\n"
    "if target == '-m':\n"
    "    sys.argv = sys.argv[1:]\n"
    "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
    "else:\n"
    "    runpy.run_path(target, run_name='__main__')\n"
)


def _run_measured(args: list[str], env: dict | None = None) -> tuple[int, str, float, float]:
    """Run ``python args`` in the repository: (exit status, stderr, seconds, peak resident set in MB).

    The peak is the process's own ``VmHWM`` read at exit (``ru_maxrss`` would count the forking parent's pages)."""
    with tempfile.NamedTemporaryFile(suffix=".hwm") as hwm:
        started = time.perf_counter()
        env = {**os.environ, **(env or {}), "NOLOCO_TEST_HWM": hwm.name}
        proc = subprocess.run([sys.executable, "-c", _HIGH_WATER, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=env)  # fmt: skip
        seconds = time.perf_counter() - started
        text = Path(hwm.name).read_text().strip()
    return proc.returncode, proc.stderr.decode(), seconds, int(text) / 1024 if text else float("nan")


def _llama_config(folder: Path, **sizes) -> Path:
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 128, "tie_word_embeddings": True, **sizes}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _word_level_tokenizer(path: Path, entries: int) -> Path:
    """A tokenizers JSON file of ``entries`` vocabulary entries (written without building it in memory)."""
    with open(path, "w") as handle:
        handle.write('{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,'
                     '"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":'
                     '{"type":"WordLevel","unk_token":"[UNK]","vocab":{"[UNK]":0,"<|endoftext|>":1')  # fmt: skip
        for start in range(2, entries, 100_000):
            handle.write("".join(f',"t{i}":{i}' for i in range(start, min(entries, start + 100_000))))
        handle.write("}}}")
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_cache):
    from tests.conftest import SMOKE

    root = tmp_path_factory.mktemp("finished")
    assert main([*SMOKE, f"data.cache_dir={data_cache}", f"run.dir={root}", "run.name=r", *TINY]) == 0
    return root / "r"


@pytest.mark.slow
def test_sizes_read_from_files_are_refused_before_they_are_allocated(finished_run, tmp_path, smoke_overrides,
                                                                     data_cache):  # fmt: skip
    """An HF config.json of 10^5 layers or hidden size 10^6, a checkpoint config.yaml of 10^5 layers or a
    vocabulary of 10^12, a tokenizer.json of 3M entries: each one ``error:`` line naming the key that raises the
    bound, exit 2, at most 256 MB more than the process needs to refuse a bad key (peak RSS of a real
    ``train.py`` / ``noloco.export`` process). Times are measured, not asserted (docs/reliability.md)."""
    smoke = [*smoke_overrides, f"data.cache_dir={data_cache}", f"run.dir={tmp_path / 'runs'}"]
    copies = {}
    for name, key, value in (("layers", "model.n_layers", 10**5), ("vocab", "data.vocab_size", 10**12)):
        run = tmp_path / name
        shutil.copytree(finished_run, run, symlinks=True)
        saved = run / "checkpoints" / "latest" / "config.yaml"
        cfg = OmegaConf.load(saved)
        OmegaConf.update(cfg, key, value)
        saved.write_text(OmegaConf.to_yaml(cfg))
        copies[name] = run
    cases = {
        "baseline: an unknown key": (["train.py", "no.such.key=1"], "unknown config key"),
        "HF config.json: 10^5 layers": (["train.py", *smoke, "model.source=hf",
                                         f"model.hf_path={_llama_config(tmp_path / 'deep', num_hidden_layers=10**5)}"],
                                        "model.max_memory_gb"),
        "HF config.json: hidden size 10^6": (["train.py", *smoke, "model.source=hf", "model.hf_path="
                                              f"{_llama_config(tmp_path / 'wide', hidden_size=10**6)}"],
                                             "model.max_memory_gb"),
        "checkpoint config.yaml: 10^5 layers (resume)": (
            ["train.py", f"resume={copies['layers']}/checkpoints/latest", "steps=20"], "model.max_memory_gb"),
        "checkpoint config.yaml: 10^5 layers (export)": (
            ["-m", "noloco.export", str(copies["layers"]), "--out", str(tmp_path / "out")], "model.max_memory_gb"),
        "checkpoint config.yaml: vocab_size 10^12 (resume)": (
            ["train.py", f"resume={copies['vocab']}/checkpoints/latest", "steps=20"], "data.max_vocab_size"),
        "tokenizer.json: 3M entries": (["train.py", *smoke, "data.tokenizer="
                                        f"{_word_level_tokenizer(tmp_path / 'huge.json', 3_000_000)}"],
                                       "data.max_vocab_size"),
    }  # fmt: skip
    baseline = None
    for case, (args, key) in cases.items():
        code, err, seconds, rss = _run_measured(args)
        assert code == 2, (case, err[-2000:])
        _one_error_line(err, key)
        baseline = rss if baseline is None else baseline
        REFUSAL_FIGURES[case] = (seconds, rss, rss - baseline)
        assert rss - baseline <= 256, (case, rss, baseline)
    print("\n".join(f"{case}: {s:.2f} s, peak RSS {mb:.0f} MB ({above:+.0f})"
                    for case, (s, mb, above) in REFUSAL_FIGURES.items()))  # fmt: skip
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()  # nothing written


# ------------------------------------------------------------------------------- one line, not a traceback


class _Payload:
    """Pickles as a call of ``os.system``: a pickled weights file that would run code if unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_pytorch_model_bin_is_one_line_and_never_run(tiny_overrides, tmp_path, capsys):
    import pickle

    folder = _llama_config(tmp_path / "pickled")
    marker = tmp_path / "ran"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": _Payload(marker)}))
    code = main([*tiny_overrides, "model.source=hf", f"model.hf_path={folder}", "workers=2", "steps=2"])
    assert code == 2
    _one_error_line(capsys.readouterr().err, "not a causal LM transformers can build or load")
    assert not marker.exists()


def test_hf_weights_whose_shapes_disagree_with_config_json_are_one_line(tiny_overrides, tmp_path, capsys):
    from tests.train.test_hf import tiny_llama

    folder = tiny_llama(tmp_path / "llama", 512, weights=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    capsys.readouterr()
    code = main([*tiny_overrides, "model.source=hf", f"model.hf_path={folder}", "workers=2", "steps=2"])
    err = capsys.readouterr().err
    assert code == 2, err
    _one_error_line(err, "mlp.down_proj.weight has shape (32, 64)")


@pytest.mark.parametrize("tool", ["noloco.export", "noloco.sample"])
@pytest.mark.parametrize("garbage", ["steps: [unclosed", "- a list\n- not a mapping\n"])
def test_an_unparseable_config_yaml_is_one_line_in_export_and_sample(finished_run, tmp_path, capsys, tool, garbage):
    import importlib

    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    (run / "checkpoints" / "latest" / "config.yaml").write_text(garbage)
    before = _snapshot(run)
    args = [str(run), "--out", str(tmp_path / "out")] if tool == "noloco.export" else [str(run), "--tokens", "2"]
    assert importlib.import_module(tool).main(args) == 2
    _one_error_line(capsys.readouterr().err, "config.yaml")
    assert _snapshot(run) == before and not (tmp_path / "out").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_previous_checkpoint_is_intact(
    smoke_overrides, data_cache, tmp_path, capsys
):
    """A real filesystem that fills up: a 9 MB tmpfs holds the run, its first checkpoint (2 workers × 3.4 MB)
    fits, the second does not. One line says how much was needed and which checkpoint is intact; it resumes."""
    from noloco.train import checkpoint

    with _tmpfs(tmp_path / "disk", "9m") as disk:
        args = [*smoke_overrides, f"data.cache_dir={data_cache}", f"run.dir={disk}", "run.name=r", *TINY,
                "steps=15", "checkpoint.keep=3"]  # fmt: skip
        assert main(args) == 2
        line = _one_error_line(capsys.readouterr().err, "no space left")
        assert "MB" in line and "needs" in line and "(step 5) is intact" in line, line
        run = disk / "r"
        folder, _, step = checkpoint.resolve(run / "checkpoints" / "latest")
        assert step == 5
        checkpoint.load_run(folder, step, [0, 1])  # every worker's state loads and checks
        assert not [p for p in run.rglob(".*") if p.name.endswith(".tmp")]  # no temporary file left
        assert not (checkpoint.step_dir(run, 10) / checkpoint.COMPLETE).exists()


@contextlib.contextmanager
def _tmpfs(disk: Path, size: str):
    """A real filesystem of ``size`` mounted at ``disk`` (made) for the block, unmounted after it."""
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _fill(disk: Path) -> None:
    """Fill ``disk`` to its last page with a file named ``filler``."""
    with open(disk / "filler", "wb", buffering=0) as handle, pytest.raises(OSError):
        while True:
            handle.write(b"x" * 4096)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_metrics_held_back_by_a_full_disk_follow_once_there_is_space(tmp_path, capsys):
    """Another worker's checkpoint may fill the disk for a moment (then report it and free its partial file): a
    record logged meanwhile waits in memory and is written, whole and in order, with the next one."""
    from noloco.train.metrics import MetricsLogger, read_metrics

    with _tmpfs(tmp_path / "disk", "1m") as disk:
        logger = MetricsLogger(disk / "run", tensorboard=False)
        try:
            logger.log({"worker": 0, "step": 0, "loss": 1.0})
            _fill(disk)
            for step in (1, 2):  # no room: held back, no error
                logger.log({"worker": 0, "step": step, "loss": 1.0 / (step + 1), "note": "x" * 5000})  # > a page
            (disk / "filler").unlink()
            logger.log({"worker": 0, "step": 3, "loss": 0.25})
            logger.log({"worker": 0, "step": 4, "loss": 0.2})
            _fill(disk)
            logger.log({"worker": 0, "step": 5, "loss": 0.1, "note": "x" * 5000})
        finally:
            logger.close()  # still full: one line says what is missing, the cleanup does not fail
        assert "could not be written: no space left" in capsys.readouterr().err
        assert [r["step"] for r in read_metrics(disk / "run")] == [0, 1, 2, 3, 4]  # step 5: a cut last line


@pytest.mark.slow
def test_a_peer_whose_bootstrap_peer_has_exited_is_one_line(tiny_overrides, tmp_path):
    from noloco.swarm.identity import PeerIdentity

    gone = f"/ip4/127.0.0.1/tcp/9/p2p/{PeerIdentity.generate().peer_id}"  # the discard port: nobody answers
    code, err, _, _ = _run_measured(["train.py", *tiny_overrides, "backend=hivemind", f"peer.initial_peers=[{gone}]",
                                     "comm.startup_timeout=10", "steps=2"],
                                    env={"NOLOCO_RUN_KEY": "k" * 32})  # fmt: skip
    assert code == 2, err[-2000:]
    _one_error_line("\n".join(x for x in err.splitlines() if not x.startswith("noloco peer:")), "initial_peers")


# ------------------------------------------------------------------------------------------- stalls


@pytest.mark.slow
def test_a_stalled_run_dumps_every_stack_says_where_each_worker_waits_and_exits(tiny_overrides, tmp_path):
    """Worker 1 sleeps 60 s before its exchange at step 10 (NOLOCO_FAULTS) and worker 0 waits for it, within
    comm.recv_timeout: no worker advances. With run.stall_timeout=3 the run exits with status 3, one line naming
    both workers and what they wait for, every thread's stack in the run folder, the step-5 checkpoint intact."""
    from noloco.train import checkpoint
    from noloco.train.stall import STALL_EXIT

    code, err, _, _ = _run_measured(["train.py", *tiny_overrides, *TINY, "run.name=s", "steps=20",
                                           "run.stall_timeout=3"],
                                          env={"NOLOCO_FAULTS": "outer.exchange@10/1=sleep:60"})  # fmt: skip
    assert code == STALL_EXIT, err[-2000:]  # the detector ended it: the sleep's end would have let the run finish
    line = _one_error_line(err, "no worker advanced")
    assert "worker 0 after step 9: step 10 and its outer exchange" in line
    assert "worker 1 after step 9: step 10 and its outer exchange" in line
    assert "(step 5) is intact" in line
    run = tmp_path / "s"
    (stacks,) = run.glob("stall-*.txt")
    text = stacks.read_text()
    assert "in fire" in text and "exchange_round" in text  # the sleeping worker's stack: inside the fault
    assert text.count("Thread 0x") + text.count("Current thread 0x") >= 3
    folder, _, step = checkpoint.resolve(run / "checkpoints" / "latest")
    assert step == 5
    checkpoint.load_run(folder, step, [0, 1])
    assert not list(run.rglob("*.tmp"))


# --------------------------------------------------------------------------- the same on the torch backend


def _error_lines(err: str) -> list[str]:
    """stderr's lines but the run's header: each must be a rank's own ``error:`` line, no traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("noloco:", "warning:", "note:"))]
    assert lines and all(x.startswith("error: ") for x in lines), err[-3000:]
    return lines


@pytest.mark.slow
def test_a_stalled_torch_run_exits_3_with_each_ranks_line_and_no_traceback(tiny_overrides, tmp_path):
    """The detector runs in each rank's process: each stalled rank prints its line and exits 3, and the launcher
    exits 3 with nothing more (it raised a RuntimeError traceback, exit 1)."""
    from noloco.train import checkpoint
    from noloco.train.stall import STALL_EXIT

    code, err, _, _ = _run_measured(["train.py", *tiny_overrides, *TINY, "backend=torch", "run.name=s", "steps=20",
                                     "run.stall_timeout=3"],
                                    env={"NOLOCO_FAULTS": "outer.exchange@10/1=sleep:60"})  # fmt: skip
    assert code == STALL_EXIT, err[-3000:]
    # on a loaded machine rank 1's detector can fire and its process exit before rank 0's detector does: rank 0
    # then finds the link lost, skips the round and trains on alone (a dead partner costs a round, by design),
    # and says of each later checkpoint that rank 1 never completed it; those warnings are its only other lines
    gone = re.compile(r"worker 0: checkpoint of step \d+ left incomplete \(rank 0: link to rank 1 lost")
    lines = _error_lines("\n".join(x for x in err.splitlines() if not gone.match(x)))
    assert all("no worker advanced" in x and "(step 5) is intact" in x for x in lines), lines
    assert any("worker 1 after step 9" in x for x in lines), lines
    run = tmp_path / "s"
    assert run.glob("stall-*.txt")
    folder, _, step = checkpoint.resolve(run / "checkpoints" / "latest")
    assert step == 5
    checkpoint.load_run(folder, step, [0, 1])


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_on_the_torch_backend_is_each_ranks_line_and_exit_2(smoke_overrides, data_cache, tmp_path):
    """A rank whose checkpoint does not fit prints its DiskFull line and exits 2 (it printed a traceback, and the
    launcher another, exit 1); the previous checkpoint stays complete and loads."""
    from noloco.train import checkpoint

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        args = ["train.py", *smoke_overrides, f"data.cache_dir={data_cache}", f"run.dir={disk}", "run.name=r", *TINY,
                "backend=torch", "steps=15", "checkpoint.keep=3"]  # fmt: skip
        code, err, _, _ = _run_measured(args)
        assert code == 2, err[-3000:]
        lines = _error_lines(err)
        assert any("no space left" in x and "(step 5) is intact" in x for x in lines), lines
        folder, _, step = checkpoint.resolve(disk / "r" / "checkpoints" / "latest")
        assert step == 5
        checkpoint.load_run(folder, step, [0, 1])
    finally:
        subprocess.run(["umount", str(disk)], check=True)
