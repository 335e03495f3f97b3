"""Wall time of `planner fit 1T --gpus 16` from process start to exit (issue target: < 1 s).

Runs the installed console script (falls back to `python -m tierwise`) several times and reports the
median and the worst, and whether torch was imported along the way. Prints JSON.
Usage: python benchmarks/planner_speed.py [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time


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
    args = parser.parse_args()
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
        "repeats": args.repeats,
        "median_s": round(statistics.median(samples), 3),
        "max_s": round(max(samples), 3),
        "target_s": 1.0,
        "torch_imported": probe.stdout.strip() == "True",
        "machine": f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}".strip(),
    }
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
