"""The studies' reports: a markdown table, the JSON of everything measured and plots, with command and machine.

:func:`write_consensus` and :func:`write_time` take what :func:`noloco.sim.consensus.run_study` and
:func:`noloco.sim.wan.run_study` return and write ``<name>.md``, ``<name>.json`` and ``<name>-*.png`` into a
folder (created if needed).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


def machine() -> str:
    """One line describing this machine: CPU architecture, cores, memory, OS, Python, torch, GPUs."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f"{pages / 2**30:.0f} GiB memory, "
    except (ValueError, OSError, AttributeError):
        memory = ""
    gpus = "no GPU"
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()}× {torch.cuda.get_device_name(0)}"
    return (f"{platform.machine()}, {os.cpu_count()} cores, {memory}{platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, {gpus}")  # fmt: skip


def command(argv: list[str] | None = None) -> str:
    """``python -m noloco.sim`` and ``argv`` (default: this process's arguments), quoted for a POSIX shell."""
    return shlex.join(["python", "-m", "noloco.sim", *(sys.argv[1:] if argv is None else argv)])


def _header(title: str, data: dict) -> list[str]:
    return [f"# {title}", "", f"Command: `{data['command']}`  ", f"Machine: {data['machine']}  ",
            f"Date: {data['date']}", ""]  # fmt: skip


def stamp(data: dict, argv: list[str] | None = None) -> dict:
    """``data`` with the command (of ``argv``), machine and UTC date added (mutated and returned)."""
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data.update(command=command(argv), machine=machine(), date=date)
    return data


def _fmt(value, spec: str = ".4f") -> str:
    return "–" if value is None else format(value, spec)


# --- consensus ---------------------------------------------------------------------------------------


def consensus_tables(data: dict) -> list[str]:
    """The markdown tables of a consensus study."""
    lines = ["## Pure averaging model: rounds to shrink the spread 100×", "",
             f"`x ← x + m, m ← μ·m + γ·(mean_G(x) − x)`, γ = {data['config']['pull']}, seeded random groups, "
             f"{data['config']['averaging_trials']} seeds per N (mean, [min–max]). Large-N limit for pairs with μ = 0: "
             f"{data['predicted_rounds_large_n']:.1f} rounds.", "",
             "| N | pairs, μ = 0 | groups of 4, μ = 0 | pairs, μ = 0.5 (NoLoCo's) | groups of 4, μ = 0.5 |",
             "|---|---|---|---|---|"]  # fmt: skip
    cells: dict[int, dict] = {}
    for row in data["averaging"]:
        value = (
            "not reached"
            if row["rounds_mean"] is None
            else (f"{row['rounds_mean']:.1f} [{row['rounds_min']}–{row['rounds_max']}]")
        )
        cells.setdefault(row["workers"], {})[(row["group_size"], row["momentum"])] = value
    for n in sorted(cells):
        c = cells[n]
        lines.append(f"| {n} | {c.get((2, 0.0), '–')} | {c.get((4, 0.0), '–')} | {c.get((2, 0.5), '–')} | "
                     f"{c.get((4, 0.5), '–')} |")  # fmt: skip
    cfg = data["config"]
    lines += ["", "## Training: stacked workers", "",
              f"LLaMA dim {cfg['dim']}, {cfg['n_layers']} layers, "
              f"{data['runs'][0]['parameters'] if data['runs'] else 0:,} "
              f"parameters, vocab {data['vocab_size']} ({cfg['source']}); batch {cfg['batch_size']}×{cfg['seq_len']} "
              f"tokens per worker and step, AdamW lr {cfg['lr']}, H = {cfg['every']}, {cfg['rounds']} outer rounds; "
              "NoLoCo β = γ = 0.7, μ = 0.5; DiLoCo lr 0.7, μ 0.9 (the library's defaults). Consensus distance = "
              "sqrt(mean_i ‖x_i − x̄‖²) / ‖x̄‖ of the flat weights; θ: the fast weights after the inner steps, φ: "
              "the slow weights after the outer step. Relax: rounds of outer steps without training until φ's "
              "spread is 100× smaller.", "",
              "| N | method | held-out loss (mean over workers) | consensus θ | consensus φ | "
              "mean consensus θ, 2nd half | "
              "relax 100× (rounds) | seconds |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in data["runs"]:
        last = run["history"][-1]
        half = run["history"][1 + len(run["history"]) // 2 :] or run["history"][-1:]
        mean_fast = sum(h["spread_fast"] for h in half) / len(half)
        lines.append(f"| {run['workers']} | {run['method']} | {last['eval_loss']:.4f} | {last['spread_fast']:.2e} | "
                     f"{last['spread_slow']:.2e} | {mean_fast:.2e} | {_fmt(run['relax_rounds_100x'], 'd')} | "
                     f"{run['seconds']:.1f} |")  # fmt: skip
    return lines


def consensus_plots(data: dict, out: Path, name: str) -> list[str]:
    """Consensus distance and held-out loss against outer rounds, one panel per N; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({run["workers"] for run in data["runs"]})
    if not ns:
        return []
    files = []
    for key, label, logy in (("spread", "consensus distance", True), ("eval_loss", "held-out loss", False)):
        fig, axes = plt.subplots(1, len(ns), figsize=(4 * len(ns), 3.4), squeeze=False, sharey=True)
        for ax, n in zip(axes[0], ns):
            for run in (r for r in data["runs"] if r["workers"] == n):
                rounds = [h["round"] for h in run["history"]]
                if key == "spread":
                    ax.plot(rounds[1:], [h["spread_fast"] for h in run["history"][1:]], label=f"{run['method']} θ")
                    if run["method"].startswith("noloco"):
                        ax.plot(rounds[1:], [h["spread_slow"] for h in run["history"][1:]], "--",
                                label=f"{run['method']} φ")  # fmt: skip
                else:
                    ax.plot(rounds, [h["eval_loss"] for h in run["history"]], label=run["method"])
            ax.set_title(f"N = {n}")
            ax.set_xlabel("outer round")
            if logy:
                ax.set_yscale("log")
        axes[0][0].set_ylabel(label)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        file = f"{name}-{key.replace('_', '-')}.png"
        fig.savefig(out / file, dpi=110)
        plt.close(fig)
        files.append(file)
    return files


def write_consensus(data: dict, out: Path, name: str) -> Path:
    """Write ``name``.md/.json/-*.png of a consensus study into ``out``; returns the markdown's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    lines = _header("Consensus at scale: stacked workers and the pure averaging model", data)
    lines += consensus_tables(data)
    lines += [""] + [f"![{file}]({file})" for file in consensus_plots(data, out, name)]
    path = out / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# --- time --------------------------------------------------------------------------------------------------


def time_tables(data: dict) -> list[str]:
    """The markdown tables of a time study."""
    cfg = data["config"]
    lines = ["## Model: sync time and idle against N", "",
             f"Links: rate log-normal, median {cfg['bandwidth'] / 1e6:g} Mbit/s each way "
             f"(σ of ln {cfg['bandwidth_sigma']}), "
             f"median pair round trip {cfg['rtt'] * 1e3:g} ms (σ {cfg['rtt_sigma']}); stragglers "
             f"{cfg['straggler_fraction']:.0%} at {cfg['straggler_factor']:g}× slower (link and compute). Payload "
             f"{cfg['parameters']:,} parameters in {cfg['codec']} = {data['payload_bytes'] / 1e6:.1f} MB (DDP: "
             f"{cfg['ddp_codec']}, {data['ddp_payload_bytes'] / 1e6:.1f} MB per step, H = {cfg['every']}); compute "
             f"{cfg['compute']} s per round; matchmaking {cfg['matchmaking']} s + {cfg['dht_lookups']} DHT lookups × "
             "⌈log₂ N⌉ hops × median RTT + 1 RTT to confirm + the reads of the round's announcements "
             f"({cfg.get('window_reads', 0)} reads × N/B × {cfg.get('record_bytes', 0)} B per peer over "
             f"B = {cfg.get('buckets', 1)} DHT key(s), each served by {cfg.get('dht_replicas', 0)} DHT nodes: "
             "(N/B)² records a round) (swarm only).", "",
             "sync = one round's exchange with every peer ready at once (mean over peers [max]); round and idle: "
             f"{cfg['rounds']} rounds of compute and exchange, each peer on its own clock.", "",
             "| N | method | sync (s) | round (s) | round, normal peers (s) | idle fraction |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in data["rows"]:
        lines.append(
            f"| {row['workers']} | {row['method']} | {row['sync_s']:.2f} [{row['sync_s_max']:.2f}] | "
            f"{row['round_s']:.2f} | {_fmt(row['round_s_normal'], '.2f')} | {row['idle_fraction']:.1%} |"
        )
    lines += ["", "## The paper's claim: sync ≈ 10× faster than all-reduce at ~1k", "",
              "Ratios of mean sync times at N = 1,024 (all peers ready at once).", "",
              "| conditions | ring (s) | tree (s) | NoLoCo pairs (s) | swarm pairs (s) | tree ÷ pairs | ring ÷ pairs | "
              "tree ÷ swarm |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in data["claim"]:
        lines.append(f"| {row['scenario']} | {row['diloco-ring_s']:.2f} | {row['diloco-tree_s']:.2f} | "
                     f"{row['noloco-g2_s']:.2f} | {row['swarm-g2_s']:.2f} | {row['tree_over_pairs']:.1f}× | "
                     f"{row['ring_over_pairs']:.1f}× | {row['tree_over_swarm']:.1f}× |")  # fmt: skip
    lines += ["", "## Calibration against the throttled fleet (docs/results)", "",
              "Predicted = link time (full or half duplex) + a fixed seconds per outer exchange fitted on each "
              "report's blocking noloco/int4 run (*fit*). The link time takes the payload efficiency (payload bits ÷ "
              "rate × seconds) bare TCP traffic of the exchange's pattern and size had through the fleet's links at "
              "that rate and bucket: full duplex, a pair's one connection both ways at once or, for three or more "
              "hosts, the two-phase reduction's traffic (every host sending to each other at once; measured "
              "among 4 hosts, applied by bytes per host to 8); half duplex, one way (benchmarks/link_probe.py, "
              "noloco.sim.wan.link_efficiency; 1 ÷ 1.07 for headers and ACKs where none was measured), less the "
              "bucket's head start. Transport: `full` posts receives ahead (now), `half` is the "
              "transport before, whose directions took turns part of the time. Overlapped rounds: max(compute, "
              f"c × exchange), c = {_slowdown(data)} the exchange's slowdown beside training, fitted on one report's "
              "overlapped exchanges (noloco.sim.wan.overlap_slowdown).", "",
              "| report | method | hosts | Mbit/s | bucket (ms) | transport | quantity | measured (s) | "
              "efficiency full / half | link full / half (s) | fixed (s) "
              "| predicted full (s) | error full | predicted half (s) | error half |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in data["calibration"]:
        fit = " (*fit*)" if p.get("fit") else ""
        lines.append(f"| {p['report']} | {p['method']}{fit} | {p['hosts']} | {p['rate_mbit']:g} | "
                     f"{1000 * p['burst_seconds']:g} | {p['transport']} | {p['quantity']} | {p['measured']:.3f} | "
                     f"{p['efficiency_full']:.3f} / {p['efficiency_half']:.3f} | "
                     f"{p['link_full']:.3f} / {p['link_half']:.3f} | "
                     f"{p['fixed']:.3f} | {p['predicted_full']:.3f} | {p['error_full']:+.0%} | "
                     f"{p['predicted_half']:.3f} | {p['error_half']:+.0%} |")  # fmt: skip
    return lines


def _slowdown(data: dict) -> str:
    """The overlap slowdown the calibration applied, as the table's text gives it."""
    values = {p["slowdown"] for p in data["calibration"] if "slowdown" in p}
    return ", ".join(f"{v:.2f}" for v in sorted(values)) or "(no overlapped point)"


def time_plots(data: dict, out: Path, name: str) -> list[str]:
    """Sync time and idle fraction against N per method, and the model against the fleet; returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, calib) = plt.subplots(1, 3, figsize=(15, 4))
    for method in dict.fromkeys(row["method"] for row in data["rows"]):
        rows = [r for r in data["rows"] if r["method"] == method]
        ns = [r["workers"] for r in rows]
        left.plot(ns, [r["sync_s"] for r in rows], "o-", label=method)
        right.plot(ns, [r["idle_fraction"] for r in rows], "o-", label=method)
    left.set(xscale="log", yscale="log", xlabel="workers N", ylabel="sync time per round (s)", title="model: sync")
    right.set(xscale="log", xlabel="workers N", ylabel="idle fraction", title="model: idle over rounds")
    right.legend(fontsize=7)
    for transport, marker in (("full", "o"), ("half", "x")):
        points = [p for p in data["calibration"] if p["transport"] == transport and not p.get("fit")]
        calib.plot([p["measured"] for p in points], [p["predicted"] for p in points], marker, ls="none",
                   label=f"fleet runs, transport {transport}")  # fmt: skip
    span = [p[k] for p in data["calibration"] for k in ("measured", "predicted")]
    if span:
        low, high = min(span) * 0.8, max(span) * 1.25
        calib.plot([low, high], [low, high], "k-", lw=0.8)
        calib.fill_between([low, high], [low * 0.85, high * 0.85], [low * 1.15, high * 1.15], color="k", alpha=0.1,
                           label="±15%")  # fmt: skip
    calib.set(xscale="log", yscale="log", xlabel="measured (s)", ylabel="model (s)",
              title="model against the real fleet (per exchange or round)")  # fmt: skip
    calib.legend(fontsize=7)
    fig.tight_layout()
    file = f"{name}.png"
    fig.savefig(out / file, dpi=110)
    plt.close(fig)
    return [file]


def write_time(data: dict, out: Path, name: str) -> Path:
    """Write ``name``.md/.json/.png of a time study into ``out``; returns the markdown's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    lines = _header("Sync time at scale: the WAN model", data) + time_tables(data)
    lines += [""] + [f"![{file}]({file})" for file in time_plots(data, out, name)]
    path = out / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
