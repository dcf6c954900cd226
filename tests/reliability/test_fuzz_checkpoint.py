"""Fuzz of what resume reads from a worker's checkpoint JSON (issue #32): mutated bytes, and every plain value
forged to an arbitrary JSON value, each checked by ``checkpoint.load_worker`` and the run's state owners
(:class:`~noloco.train.state.WorkerState`, with the optimizer and LR schedule the run builds) exactly as
``train.py resume=`` checks it: a state is accepted only with every value within its bounds (a forged eval
loss of 2, a flag set to a value it may hold), anything else is one :class:`CheckpointError`, never another
exception.
And the tokenizer entry count (:func:`noloco.data.tokenizer.count_entries`) bounds every mutated tokenizer file.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.utils import parameters_to_vector

from noloco.data.tokenizer import count_entries
from noloco.train import checkpoint
from noloco.train.backends.local import launch as run
from noloco.train.loop import build_inner_optimizer, build_model
from noloco.train.state import WorkerState

from .fuzzing import fuzz_settings, mutate, record

COMMON = ("workers=2", "threads=1", "steps=15", "outer.every=5", "checkpoint.every=5", "log.tensorboard=false",
          "log.plot=false")  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint_copy(tmp_path_factory, data_cache):
    """A real tiny run's step-10 checkpoint (2 workers) and the Layout its run checks it against."""
    from noloco.train.config import load_config
    from tests.conftest import SMOKE

    root = tmp_path_factory.mktemp("fuzz-ckpt")
    cfg = load_config([*SMOKE, f"data.cache_dir={data_cache}", f"run.dir={root}", "run.name=r", *COMMON])
    run(cfg, quiet=True, stop_after=10)
    folder = checkpoint.step_dir(root / "r", 10)
    with torch.device("meta"):
        model = build_model(cfg, cfg.data.vocab_size)
        opt, schedule = build_inner_optimizer(cfg, model)
    layout = WorkerState.for_check(model, opt, schedule, outer=True)
    layout.seed_digest = checkpoint.digest(parameters_to_vector(build_model(cfg, cfg.data.vocab_size).parameters()))
    return folder, layout


def _check(folder, layout) -> bool:
    """True if the worker's state is accepted; False if refused with a CheckpointError (anything else raises)."""
    try:
        state = checkpoint.load_worker(folder, 0, 10)
        vocab = checkpoint.state_vocab_size(state)
        if vocab is not None and vocab != layout.vocab_size:
            raise checkpoint.CheckpointError("another vocabulary")  # Run.check_resume builds no other model
        layout.check(state, 10)
        reference = state["algorithm"]["reference"]
        if isinstance(reference, dict) and reference["sha256"] != layout.seed_digest:  # as Run.check_resume
            raise checkpoint.CheckpointError("not the initial weights of run.seed")
    except checkpoint.CheckpointError:
        return False
    return True


def _leaves(node, path=()):
    if isinstance(node, dict) and "__dict__" in node:
        for i, (_, value) in enumerate(node["__dict__"]):
            yield from _leaves(value, (*path, ("__dict__", i, 1)))
    elif isinstance(node, dict) and "__tuple__" in node:
        for i, value in enumerate(node["__tuple__"]):
            yield from _leaves(value, (*path, ("__tuple__", i, None)))
    elif isinstance(node, dict) and "__tensor__" not in node:
        for key, value in node.items():
            yield from _leaves(value, (*path, (key, None, None)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, (i, None, None)))
    elif not isinstance(node, dict):
        yield path


def _set(node, path, value) -> None:
    *head, last = path
    for key, index, slot in head:
        node = node[key] if index is None else node[key][index]
        node = node if slot is None else node[slot]
    key, index, slot = last
    if index is None:
        node[key] = value
    elif slot is None:
        node[key][index] = value
    else:
        node[key][index][slot] = value


_JSON = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                  st.sampled_from([0, 1, -1, 1e300, -0.0, math.inf, 10**12]), st.text(max_size=8),
                  st.lists(st.integers(0, 3), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))  # fmt: skip


def test_forged_plain_values_of_a_worker_json_are_refused_or_unchanged(checkpoint_copy, tmp_path):
    source, layout = checkpoint_copy
    folder = tmp_path / "step_000010"
    shutil.copytree(source, folder)
    original = (source / "worker_0.json").read_text()
    meta = json.loads(original)
    paths = list(_leaves(meta))
    assert _check(folder, layout)

    @fuzz_settings(400)
    @given(data=st.data())
    def case(data):
        forged = json.loads(original)
        for _ in range(data.draw(st.integers(1, 3))):
            _set(forged, data.draw(st.sampled_from(paths)), data.draw(_JSON))
        (folder / "worker_0.json").write_text(json.dumps(forged))
        accepted = _check(folder, layout)
        record("checkpoint worker JSON (forged values)", accepted)

    case()


def test_mutated_worker_json_bytes_are_refused_or_unchanged(checkpoint_copy, tmp_path):
    source, layout = checkpoint_copy
    folder = tmp_path / "step_000010"
    shutil.copytree(source, folder)
    original = (source / "worker_0.json").read_bytes()

    @fuzz_settings(300)
    @given(data=st.data())
    def case(data):
        _, mutated = mutate(data, original)
        (folder / "worker_0.json").write_bytes(mutated)
        record("checkpoint worker JSON (bytes)", _check(folder, layout))

    case()


def test_the_tokenizer_entry_count_bounds_every_mutated_file(tmp_path):
    """:func:`count_entries` reads 16 MiB chunks without parsing: any file, any bytes, never fewer ``":`` than
    the file holds (the pre-check of data.max_vocab_size never lets more entries through than it counts)."""
    vocab = {f"t{i}": i for i in range(500)}
    original = json.dumps({"model": {"type": "WordLevel", "vocab": vocab}}).encode()
    path = tmp_path / "tokenizer.json"

    @fuzz_settings(300)
    @given(data=st.data())
    def case(data):
        _, mutated = mutate(data, original)
        path.write_bytes(mutated)
        assert count_entries(path, 10**9) == mutated.count(b'":')
        record("tokenizer entry count", True)

    case()


def test_model_sizes_of_a_config_json_are_an_estimate_or_one_model_error():
    """:func:`noloco.models.hf.config_parameters` on sizes of every JSON type: a parameter count (an int, each
    size an integer in [1, 2^31)) or a ModelError naming the key, never another exception."""
    from types import SimpleNamespace

    from noloco.models.hf import _SIZE_KEYS, ModelError, config_parameters

    keys = [k for names in _SIZE_KEYS.values() for k in names]

    @fuzz_settings(400)
    @given(sizes=st.dictionaries(st.sampled_from(keys), _JSON, max_size=6))
    def case(sizes):
        try:
            count = config_parameters(SimpleNamespace(**sizes), "fuzz")
        except ModelError as exc:
            assert "config.json has" in str(exc)
            record("HF config.json sizes", False)
            return
        assert isinstance(count, int) and count >= 0
        record("HF config.json sizes", True)

    case()
