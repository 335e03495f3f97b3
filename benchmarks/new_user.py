"""A new user's first runs: probe, fit a pinned small model, run it, compare (docs/calibration.md).

    python benchmarks/new_user.py [--rounds 2] [--write-results]

Every round does exactly what docs/calibration.md tells a new user to do, through the CLI:
`planner probe --out hw.json` (which, on a CPU-only machine, calibrates on its own reference runs:
planner/calibration/probe_reference.py), then for each model in `MODELS`: `planner fit` with the model's shape
and placement pinned (the planner picks the rest), `planner run --steps 10` (two warm-up steps), and
`planner compare --json`. The models are neither the probe's reference runs nor the sweep's
configurations (benchmarks/sweep.py), so the spec has never seen them. A round probes afresh, as a
new user would; rounds are repeated because a shared machine's speed can drift within minutes
(docs/notes/2026-11-23-calibration-machine-spread.md), and every round's error is reported, not only
the best.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10

MODELS = (
    ("5 x hd 576, seq 384, batch 3, host memory", ["--layers", "5", "--hidden", "576", "--heads", "9", "--seq", "384"],
     "3", "params=cpu,gradients=cpu,optimizer_states=cpu,recompute_inputs=cpu"),
    ("3 x hd 896, seq 192, batch 4, NVMe", ["--layers", "3", "--hidden", "896", "--heads", "14", "--seq", "192"],
     "4", "params=nvme,gradients=cpu,optimizer_states=nvme,recompute_inputs=cpu"),
    ("6 x hd 448, seq 320, batch 4, device", ["--layers", "6", "--hidden", "448", "--heads", "7", "--seq", "320"],
     "4", "params=gpu,gradients=gpu,optimizer_states=gpu,recompute_inputs=gpu"),
)
"""(label, shape options, batch per GPU, placement). Vocabulary 256 (byte-level) for all."""


def planner(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tierwise", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"planner {args[0]} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout


def one_round(work: Path, nvme_path: str) -> list[dict]:
    hw = work / "hw.json"
    planner("probe", "--calibrate", "--out", str(hw), "--nvme-path", nvme_path)
    rows = []
    for label, shape, batch, placement in MODELS:
        plan, profile = work / "plan.json", work / "run.json"
        planner("fit", *shape, "--vocab", "256", "--hardware", str(hw), "--batch-per-gpu", batch,
                "--placement", placement, "--nvme-path", nvme_path, "--out", str(plan))
        planner("run", str(plan), "--steps", str(STEPS), "--profile-out", str(profile), "--no-history")
        metrics = {m["metric"]: m for m in json.loads(planner("compare", str(plan), str(profile), "--json"))["metrics"]}
        time_row = metrics["iteration_time_s"]
        rows.append({"model": label, "predicted_s": time_row["predicted"], "measured_s": time_row["measured"],
                     "error": (time_row["predicted"] - time_row["measured"]) / time_row["measured"],
                     "plan": json.loads(plan.read_text())["placement"]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    machine = results_md.measure_machine(torch=True)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tierwise-new-user-") as tmp:
        for r in range(args.rounds):
            work = Path(tmp) / f"r{r}"
            work.mkdir()
            rounds.append(one_round(work, args.nvme_path or tmp))
            print(f"round {r}: " + ", ".join(f"{row['error']:+.1%}" for row in rounds[-1]), file=sys.stderr)
    errors = sorted(abs(row["error"]) for rows in rounds for row in rows)
    doc = {"rounds": rounds, "median_abs_error": statistics.median(errors), "worst_abs_error": errors[-1],
           "machine": machine.finish().to_dict()}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc, machine)
    return 0


def write_results(doc: dict, machine: results_md.MachineFacts) -> None:
    lines = ["## A new user's first runs (`benchmarks/new_user.py`)", "",
             f"`python benchmarks/new_user.py --rounds {len(doc['rounds'])} --write-results`. "
             f"{machine.describe()} Each round: "
             "a fresh `planner probe` (calibrated on its reference runs), then per model `planner fit` (shape and "
             f"placement pinned), `planner run --steps {STEPS}`, `planner compare`. Iteration time:", "",
             f"- median |error| {doc['median_abs_error']:.1%}, worst {doc['worst_abs_error']:.1%} "
             f"({sum(len(r) for r in doc['rounds'])} runs; target: median <= 10%, worst <= 25%)", "",
             "| round | model | predicted s | measured s | error |", "|---|---|---|---|---|"]
    for r, rows in enumerate(doc["rounds"]):
        lines += [f"| {r} | {row['model']} | {row['predicted_s']:.3f} | {row['measured_s']:.3f} | {row['error']:+.1%} |"
                  for row in rows]
    results_md.write_section("new_user", "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
