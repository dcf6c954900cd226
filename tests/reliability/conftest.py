"""The fuzz case counts of the reliability tests, reported at the end of the session (tiny runs: tests/conftest.py)."""

from __future__ import annotations

import json
import os

from .fuzzing import ACCEPTED, COUNTS, SCALE


def pytest_terminal_summary(terminalreporter):
    if not COUNTS:
        return
    total = sum(COUNTS.values())
    terminalreporter.section("noloco fuzz cases executed")
    terminalreporter.write_line(f"{'decoder':<44} {'cases':>8} {'accepted':>9} {'rejected':>9}")
    for name, count in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{name:<44} {count:>8,} {ACCEPTED[name]:>9,} {count - ACCEPTED[name]:>9,}")
    terminalreporter.write_line(f"{'total':<44} {total:>8,}  (NOLOCO_FUZZ_SCALE={SCALE:g})")
    path = os.environ.get("NOLOCO_FUZZ_REPORT")
    if path:
        with open(path, "w") as handle:
            cases = {name: {"cases": count, "accepted": ACCEPTED[name]} for name, count in sorted(COUNTS.items())}
            json.dump({"scale": SCALE, "total": total, "decoders": cases}, handle, indent=1)
