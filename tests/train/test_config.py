import subprocess
import sys
from pathlib import Path

import pytest

from noloco.train.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "override,message",
    [
        ("outer.nope=1", "unknown config key 'outer.nope'"),
        ("outer.group_size=3", "does not divide workers=4"),
        ("outer.algo=sgd", "outer.algo='sgd' is not one of"),
        ("comm.codec=int9", "comm.codec='int9'"),
        ("comm.codec=topk:65/64+int2", "top-k K must be in 1..C"),
        ("comm.codec=topk:64/4096+int2 comm.reduction=ring", "cannot carry the top-k codec"),
        ("comm.codec=coset3", "carries only NoLoCo's slow-weight term"),
        ("inner.grad_codec=coset4", "a coset code carries only NoLoCo's slow-weight term"),
        ("comm.slow_codec=coset2", "coset codes have 3..8 bits"),
        ("comm.error_feedback_decay=1.5", "comm.error_feedback_decay must be in (0, 1]"),
        ("workers=0", "workers must be an integer >= 1"),
        ("outer.slow_every=0", "outer.slow_every must be an integer >= 1, got 0"),
        ("outer.slow_every=1.5", "outer.slow_every must be an integer >= 1, got 1.5"),
        ("outer.slow_every=2 outer.overlap=eager", "outer.slow_every > 1 does not run with outer.overlap=eager"),
        ("outer.slow_stagger=true", "outer.slow_stagger=True must be true or false, and true needs outer.slow_every"),
        ("outer.slow_every=4 outer.slow_stagger=2", "outer.slow_stagger=2 must be true or false"),
        ("comm.codec=topk:64/4096+int2 outer.overlap=eager", "outer.slow_every null is 8 for comm.codec=topk"),
        ("model.preset=huge", "model.preset='huge'"),
        ("eval.weights=ema", "eval.weights='ema' is not one of auto, fast, slow"),
        ("peer.catch_up=sometimes", "peer.catch_up must be true or false, got 'sometimes'"),
    ],
)
def test_bad_config_fails_with_clear_message(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(override.split())


def test_a_codec_below_4_bits_alone_gives_the_split_exchange():
    """One key picks a frontier point: below 4 bits, Δ through the codec and φ − φ₀ at int4 one round in 8 (a fused
    θ − φ₀ at top-k trained worse than the unigram baseline); explicit keys win; eager runs with slow_every=1."""
    from noloco.train.run import _slow_codec

    for codec, slow in (("topk:64/4096+int2", "int4"), ("int2", "int4"), ("int4", "int4"), ("int8", "int8")):
        assert _slow_codec(load_config([f"comm.codec={codec}"])) == slow
    assert _slow_codec(load_config(["comm.codec=int2", "comm.slow_codec=int8"])) == "int8"
    assert _slow_codec(load_config(["comm.codec=int2", "outer.algo=diloco"])) == "int2"
    load_config(["comm.codec=int2", "outer.slow_stagger=true"])  # null slow_every is 8 here
    load_config(["comm.codec=topk:64/4096+int2", "outer.overlap=eager", "outer.slow_every=1"])


def test_missing_data_path_fails(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["data.source=files", f"data.path={tmp_path}/missing.txt"])


def test_algorithm_dependent_defaults():
    assert load_config(["outer.algo=diloco"]).outer.momentum == 0.3
    assert load_config([]).outer.momentum == 0.1
    assert load_config(["outer.every=7"]).eval.every == 7


def test_config_file_and_overrides_merge(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("workers: 8\nouter:\n  algo: diloco\n")
    cfg = load_config(["outer.every=5"], [str(path)])
    assert (cfg.workers, cfg.outer.algo, cfg.outer.every) == (8, "diloco", 5)


def test_cli_prints_one_line_and_exits_2_before_any_work(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "outer.group_size=3", f"run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "does not divide" in result.stderr
    assert not any(tmp_path.iterdir())


def test_every_shipped_config_file_loads():
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        load_config([], [str(path)])


def test_old_key_names_still_work_and_map_onto_the_new_ones(capsys):
    cfg = load_config(["comm.algorithm=ring", "comm.timeout=7"])
    assert cfg.comm.reduction == "ring" and cfg.comm.algorithm is None
    assert (cfg.comm.recv_timeout, cfg.comm.group_timeout, cfg.comm.startup_timeout) == (7, 7, 7)
    assert cfg.comm.timeout is None
    cfg = load_config(["backend=hivemind", "peer.rank=3"])  # a swarm has no ranks: the key is peer.worker
    assert cfg.peer.worker == 3 and cfg.peer.rank is None
    assert "peer.rank is deprecated, use peer.worker" in capsys.readouterr().err


def test_a_mistyped_key_gets_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown config key 'outer.moemntum' \(did you mean 'outer.momentum'\?\)"):
        load_config(["outer.moemntum=0.1"])


def test_each_timeout_has_its_own_key():
    cfg = load_config(["comm.recv_timeout=3", "comm.group_timeout=4", "comm.startup_timeout=5"])
    assert (cfg.comm.recv_timeout, cfg.comm.group_timeout, cfg.comm.startup_timeout) == (3, 4, 5)
    with pytest.raises(ConfigError, match="comm.group_timeout must be > 0"):
        load_config(["comm.group_timeout=0"])


def test_a_gpu_asked_for_without_one_fails_at_start_up_with_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "device=cuda"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: device=cuda but no CUDA GPU is visible here (torch.cuda.device_count() is 0); "
        "use device=cpu or device=auto"
    ]


def test_a_run_shorter_than_one_round_warns_that_it_has_no_exchange(capsys):
    load_config(["steps=10", "outer.every=20"])
    assert "no outer exchange" in capsys.readouterr().err
    load_config(["steps=40", "outer.every=20"])
    assert "no outer exchange" not in capsys.readouterr().err


def test_outer_offload_is_a_flag_and_does_not_run_with_overlap():
    assert load_config(["outer.offload=true"]).outer.offload is True
    with pytest.raises(ConfigError, match="outer.offload must be true or false"):
        load_config(["outer.offload=sometimes"])
    with pytest.raises(ConfigError, match="outer.offload does not run with outer.overlap"):
        load_config(["outer.offload=true", "outer.overlap=true"])


def _keyword_defaults(*functions) -> dict:
    """Keyword → default over ``functions``, later ones overriding (a subclass's ``__init__`` after its base's)."""
    import inspect

    out = {}
    for function in functions:
        out.update({name: p.default for name, p in inspect.signature(function).parameters.items()
                    if p.default is not inspect.Parameter.empty})  # fmt: skip
    return out


def test_the_library_defaults_are_the_defaults_yaml_values():
    """Each setting has one default: a library class's keyword default is defaults.yaml's value for its key."""
    from noloco.collectives import allreduce
    from noloco.collectives.ddp_hook import QuantizedHookState
    from noloco.optim import ALGORITHMS
    from noloco.swarm.dht import start_peer_dht
    from noloco.swarm.endpoint import SwarmEndpoint
    from noloco.swarm.matchmaking import SwarmMatchmaking
    from noloco.train.backends.local import WorldBackend
    from noloco.train.config import default_config

    cfg = default_config()
    for cls in ALGORITHMS.values():
        inits = [vars(klass)["__init__"] for klass in reversed(cls.__mro__) if "__init__" in vars(klass)]
        defaults = _keyword_defaults(*inits)
        defaults["group_timeout"] = defaults["timeout"]  # None: the same as timeout
        assert set(cls.SETTINGS) >= {"comm.codec", "comm.recv_timeout", "comm.error_feedback_decay"}
        for key, keyword in cls.SETTINGS.items():
            section, leaf = key.split(".")
            assert defaults[keyword] == cfg[section][leaf], f"{cls.__name__}({keyword}=...) vs {key} in defaults.yaml"
    others = [  # (function, keyword, key of defaults.yaml)
        (allreduce, "timeout", "comm.recv_timeout"),
        (QuantizedHookState, "timeout", "comm.recv_timeout"),
        (QuantizedHookState, "codec", "inner.grad_codec"),
        (QuantizedHookState, "error_feedback", "inner.grad_error_feedback"),
        (SwarmEndpoint.__init__, "send_timeout", "comm.recv_timeout"),
        (start_peer_dht, "startup_timeout", "comm.startup_timeout"),
        (WorldBackend.__init__, "startup_timeout", "comm.startup_timeout"),
        (SwarmMatchmaking.__init__, "confirm_timeout", "peer.confirm_timeout"),
        (SwarmMatchmaking.__init__, "timeout", "peer.matchmaking_timeout"),
    ]
    for function, keyword, key in others:
        section, leaf = key.split(".")
        default = _keyword_defaults(function)[keyword]
        assert default == cfg[section][leaf], f"{function.__qualname__}({keyword}={default}) vs {key}"


def test_an_outer_setting_flows_from_its_config_key_to_the_algorithm():
    """comm.error_feedback_decay: the config's value reaches the class through its SETTINGS, and a bad one is
    refused by the class's own check, the same line from the config and from the constructor."""
    import torch

    from noloco.comm import LocalFabric
    from noloco.optim import NoLoCo

    cfg = load_config(["comm.error_feedback_decay=0.95", "comm.codec=int2"])
    settings = NoLoCo.settings_from(cfg)
    assert settings["error_feedback_decay"] == 0.95 and settings["codec"] == "int2" and settings["seed"] == 0

    def build(transport, **extra):
        model = torch.nn.Linear(4, 2)
        return NoLoCo(model, torch.optim.AdamW(model.parameters()), transport, **{**settings, **extra})

    algos = LocalFabric(2).run(build)
    assert all(a.feedback.decay == 0.95 for a in algos)
    with pytest.raises(ValueError, match=r"comm.error_feedback_decay must be in \(0, 1\], got 1.5"):
        LocalFabric(2).run(lambda t: build(t, error_feedback_decay=1.5))
    with pytest.raises(ConfigError, match=r"comm.error_feedback_decay must be in \(0, 1\], got 1.5"):
        load_config(["comm.error_feedback_decay=1.5"])
