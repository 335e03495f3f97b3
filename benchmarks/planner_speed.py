"""Wall time of `planner fit 1T --gpus 16` from process start to exit (target: < 1 s, no torch).

Runs the installed console script (falls back to `python -m tierwise`) several times and reports the
median and the worst, and whether torch was imported along the way. Prints JSON; `--write-results`
also replaces the `planner_speed` section of benchmarks/RESULTS.md.
Usage: python benchmarks/planner_speed.py [--repeats N] [--json] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

import results_md  # benchmarks/ is on sys.path when a script runs

HEADING = "## Planner start-to-exit time (`benchmarks/planner_speed.py`)"
TARGET_S = 1.0


def time_command(cmd: list[str], repeats: int) -> list[float]:
    subprocess.run(cmd, capture_output=True, check=True)  # warm the page cache once
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    machine = results_md.measure_machine()
    exe = shutil.which("planner")
    base = [exe] if exe else [sys.executable, "-m", "tierwise"]
    fit = base + ["fit", "1T", "--gpus", "16"]
    samples = time_command(fit, args.repeats)
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, tierwise.cli, planner.search.search; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    result = {
        "command": " ".join(["planner", *fit[len(base):]]),
        "launcher": "the installed `planner` script" if exe else "`python -m tierwise`",
        "repeats": args.repeats,
        "median_s": round(statistics.median(samples), 3),
        "max_s": round(max(samples), 3),
        "runs_s": [round(t, 3) for t in samples],
        "target_s": TARGET_S,
        "torch_imported": probe.stdout.strip() == "True",
        "machine": machine.finish().to_dict(),
    }
    print(json.dumps(result, indent=None if args.json else 2))
    if args.write_results:
        results_md.write_section("planner_speed", markdown(result, machine))


def markdown(r: dict, machine: results_md.MachineFacts) -> str:
    return "\n".join([
        HEADING, "",
        f"`python benchmarks/planner_speed.py --repeats {r['repeats']} --write-results`. {machine.describe()}", "",
        f"Target: `{r['command']}` under {r['target_s']:g} s of wall time from process start to exit, no torch "
        f"imported. Each run is a fresh process ({r['launcher']}), after one warm-up run.", "",
        "| command | median | worst | spread of the runs (slowest / fastest) | torch imported |", "|---|---|---|---|---|",
        f"| `{r['command']}` | {r['median_s']:.2f} s | {r['max_s']:.2f} s | {results_md.spread(r['runs_s']):.2f}x | "
        f"{'yes' if r['torch_imported'] else 'no'} |", "",
        "Runs (s): " + ", ".join(f"{t:.3f}" for t in r["runs_s"]) + ".",
    ])


if __name__ == "__main__":
    main()
