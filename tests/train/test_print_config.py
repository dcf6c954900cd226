"""``python train.py --print-config``: the resolved config, each key with its comment from ``defaults.yaml``."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

from omegaconf import OmegaConf

from noloco.train.cli import main
from noloco.train.config import commented_yaml, key_comments, load_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = resources.files("noloco.train").joinpath("defaults.yaml").read_text()


def _printed(capsys, *argv: str) -> str:
    assert main(["--print-config", *argv]) == 0
    return capsys.readouterr().out


def _line(out: str, key: str) -> str:
    return next(line for line in out.splitlines() if line.lstrip().startswith(f"{key}:"))


def test_every_comment_of_defaults_yaml_is_printed_once_beside_the_resolved_values(capsys):
    out = _printed(capsys, "outer.every=50", "run.name='a #b'", 'peer.initial_peers=["/ip4/10.0.0.1/tcp/1/p2p/x"]')
    # every comment of the file but its opening lines, read here with a plain regex (not the code's parser)
    body = DEFAULTS.split("\nrun:", 1)[1]
    expected = [m.group(1).strip() for m in re.finditer(r"(?:^|\s)#(.*)$", body, re.M)]
    assert len(expected) > 80
    printed = [m.group(1).strip() for m in re.finditer(r"(?:^|\s)#(?!b)(.*)$", out, re.M)]
    assert printed == expected
    # overridden values are shown, with the key's comment kept
    assert re.fullmatch(r"  every: 50 +# H: inner steps between outer steps", _line(out, "every"))
    assert _line(out, "name").startswith("  name: 'a #b'") and "# default: <algo>-<codec>" in _line(out, "name")
    assert "  - /ip4/10.0.0.1/tcp/1/p2p/x" in out.splitlines()
    # a comment continued on the next line stays under it; a heading stays above its keys
    lines = out.splitlines()
    slow = lines.index(_line(out, "slow_codec"))
    assert lines[slow + 1].strip().startswith("# β = γ one fused exchange of θ − initial weights (half the bytes)")
    assert lines[slow + 1].index("#") == lines[slow].index("#")
    heading = next(i for i, line in enumerate(lines) if "# limits against hostile peers" in line)
    assert lines[heading].startswith("  # ") and lines[heading + 1].startswith("  max_unauth_per_peer:")
    # still YAML, and exactly the resolved config
    assert OmegaConf.create(out) == load_config(["outer.every=50", "run.name='a #b'",
                                                 'peer.initial_peers=["/ip4/10.0.0.1/tcp/1/p2p/x"]'])  # fmt: skip


def test_keys_that_defaults_yaml_lacks_are_printed_without_a_comment():
    cfg = load_config([])
    OmegaConf.set_struct(cfg, False)
    cfg.outer.extra_knob = 3  # a key no comment describes
    cfg.newsection = {"every": 7}  # a known key name under an unknown path
    out = commented_yaml(cfg)
    assert "  extra_knob: 3" in out.splitlines() and "newsection:" in out.splitlines()
    assert "  every: 7" in out.splitlines()  # not outer.every's comment
    assert OmegaConf.create(out) == cfg


def test_comments_are_read_per_key_path_from_the_yaml_text():
    text = "\n".join([
        "# the file's own opening comment",
        "",
        "a:                 # section a",
        "  # heading of x",
        "  x: '#1'          # x: quoted '#' is a value",
        "                   # x, continued",
        "  y: 2",
        "                   # heading of z (y has no comment to continue)",
        "  z: [1, 2]        # z",
        "b: 'it''s # not a comment'",
        "c: 1#2             # c",
    ])  # fmt: skip
    comments = key_comments(text)
    assert comments == {
        "a": ([], ["section a"]),
        "a.x": (["heading of x"], ["x: quoted '#' is a value", "x, continued"]),
        "a.y": ([], []),
        "a.z": (["heading of z (y has no comment to continue)"], ["z"]),
        "b": ([], []),
        "c": ([], ["c"]),
    }
    assert OmegaConf.create(text) == OmegaConf.create(
        commented_yaml(OmegaConf.create(text), defaults_text=text))  # fmt: skip


def test_print_config_of_a_resume_shows_the_checkpoints_values_with_comments(tmp_path):
    """The command line as a user runs it (a real process), here on a saved config's values."""
    saved = tmp_path / "run.yaml"
    saved.write_text(OmegaConf.to_yaml(load_config(["steps=37", "outer.algo=diloco"])))
    out = subprocess.run([sys.executable, "train.py", "--print-config", "--config", str(saved), "comm.codec=int8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"steps: 37 +# inner steps per worker", _line(out.stdout, "steps"))
    assert re.fullmatch(r"  algo: diloco +# noloco \| diloco \| avg \| ddp", _line(out.stdout, "algo"))
    assert _line(out.stdout, "codec").startswith("  codec: int8 ") and "# pseudo-gradients" in out.stdout
