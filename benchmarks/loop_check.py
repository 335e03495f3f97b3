"""The loop outside the sweep: probe -> fit -> run -> compare on shapes nothing was calibrated on.

    python benchmarks/loop_check.py [--rounds 1] [--write-results]

Each round does what a new user does (docs/calibration.md, "Doing it yourself"), through the CLI:
one `planner probe --out hw.json` (on a CPU-only machine it calibrates itself on its reference
runs, planner/calibration/probe_reference.py), then per configuration of `CONFIGS` `planner fit` with shape,
batch and placement pinned (the planner picks the rest), `planner run --steps 8` (two warm-up
steps) and `planner compare --json`. The configurations are neither the probe's reference runs
nor the sweep's (benchmarks/sweep.py CONFIGS, all at seq 256 and hidden 512-1024): they span small
(256-384) and large (1280-1536) hidden sizes, short (64-128) and long (512-1024) sequences and every
placement of parameters and optimizer states (device, host memory, NVMe), and include the
4-layer, hidden-512, seq-128 plan with parameters and optimizer states in host memory that
docs/notes/2026-11-25-calibration-loop-outside-sweep.md follows. Reported per
configuration: predicted and measured iteration time and phase times, and the median and worst
|error| of the iteration time (targets: each within 15 %, median within 10 %).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs
from priority import take_priority

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8
PHASES = ("forward", "backward", "optimizer")

_HOST = "params=cpu,gradients=cpu,optimizer_states=cpu"
_DEVICE = "params=gpu,gradients=gpu,optimizer_states=gpu"
_NVME = "params=nvme,gradients=cpu,optimizer_states=nvme"
CONFIGS = (
    ("issue-24: 4 x hd 512, seq 128, b 4, host", (4, 512, 8, 128), 4, _HOST),
    ("4 x hd 256, seq 64, b 8, device", (4, 256, 4, 64), 8, _DEVICE),
    ("3 x hd 320, seq 1024, b 1, device", (3, 320, 5, 1024), 1, _DEVICE),
    ("2 x hd 1280, seq 64, b 4, host", (2, 1280, 20, 64), 4, _HOST),
    ("4 x hd 384, seq 128, b 4, NVMe", (4, 384, 6, 128), 4, _NVME),
    ("2 x hd 1024, seq 512, b 1, NVMe", (2, 1024, 16, 512), 1, _NVME),
    ("2 x hd 1536, seq 128, b 2, params device, optimizer host", (2, 1536, 24, 128), 2,
     "params=gpu,gradients=cpu,optimizer_states=cpu"),
    ("4 x hd 384, seq 768, b 1, params host, optimizer NVMe", (4, 384, 6, 768), 1,
     "params=cpu,gradients=cpu,optimizer_states=nvme"),
)
"""(label, (layers, hidden, heads, seq), batch per GPU, placement). Vocabulary 256 (byte-level)."""


def planner(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tierwise", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"planner {args[0]} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout


def run_config(work: Path, hw: Path, nvme_path: str, index: int, config: tuple) -> dict:
    label, (layers, hidden, heads, seq), batch, placement = config
    plan, profile = work / f"c{index}.plan.json", work / f"c{index}.profile.json"
    planner("fit", "--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--seq", str(seq),
            "--vocab", "256", "--hardware", str(hw), "--batch-per-gpu", str(batch), "--placement", placement,
            "--nvme-path", nvme_path, "--out", str(plan))
    planner("run", str(plan), "--steps", str(STEPS), "--profile-out", str(profile), "--no-history")
    metrics = {m["metric"]: m for m in json.loads(planner("compare", str(plan), str(profile), "--json"))["metrics"]}
    doc = json.loads(plan.read_text())
    row = {"config": label, "placement": doc["placement"], "recompute_interval": doc.get("recompute_interval"),
           "tiling_factor": doc.get("tiling_factor")}
    for key in ("iteration_time_s", *(f"phase_time_s.{p}" for p in PHASES)):
        m = metrics.get(key)
        if m is not None:
            name = key.removeprefix("phase_time_s.")
            row[name] = {"predicted": m["predicted"], "measured": m["measured"],
                         "error": (m["predicted"] - m["measured"]) / m["measured"] if m["measured"] else None}
    return row


def one_round(work: Path, nvme_path: str, only: set[str] | None) -> dict:
    hw = work / "hw.json"
    load = results_md.load_now()
    started = time.perf_counter()
    planner("probe", "--calibrate", "--out", str(hw), "--nvme-path", nvme_path, "--keep-runs", str(work / "probe"))
    probe_s = time.perf_counter() - started
    rows = []
    for index, config in enumerate(CONFIGS):
        if only and not any(o in config[0] for o in only):
            continue
        rows.append(run_config(work, hw, nvme_path, index, config))
        it = rows[-1]["iteration_time_s"]
        print(f"  {config[0]}: predicted {it['predicted']:.3f} s, measured {it['measured']:.3f} s, "
              f"{it['error']:+.1%}", file=sys.stderr)
    spec = json.loads(hw.read_text())
    return {"rows": rows, "load_average_at_probe": load, "probe_s": probe_s, "spec": spec}


def summary(rows: list[dict]) -> dict:
    errors = sorted(abs(r["iteration_time_s"]["error"]) for r in rows)
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": errors[-1],
            "within_15pct": sum(e <= 0.15 for e in errors), "count": len(errors)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--nvme-path", default=None, help="swap directory (default: the work directory)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="keep every spec, plan and profile here, the probe's reference runs included (default: a "
                         "temporary directory)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of configuration labels")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--reanalyse", action="store_true",
                    help="no measuring: predict the runs kept in --work-dir again with this checkout's model")
    args = ap.parse_args()
    if args.reanalyse:
        doc = reanalyse(args.work_dir)
        for rnd in doc["rounds"]:
            for row in rnd["rows"]:
                print(f"{row['config']:58s} " + "  ".join(f"{k[:4]} {_cell(row.get(k))}" for k in
                                                          ("iteration_time_s", *PHASES)))
        s = doc["summary"]
        print(f"median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}, "
              f"{s['within_15pct']} of {s['count']} within 15%")
        if args.write_results:
            write_results(doc, reanalysed=True)
        return 0
    priority = take_priority()
    machine = results_md.measure_machine(torch=True)
    only = set(args.only.split(",")) if args.only else None
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tierwise-loop-") as tmp:
        for r in range(args.rounds):
            work = (args.work_dir or Path(tmp)) / f"r{r}"
            work.mkdir(parents=True, exist_ok=True)
            rounds.append(one_round(work, args.nvme_path or tmp, only))
            s = summary(rounds[-1]["rows"])
            print(f"round {r}: median {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}", file=sys.stderr)
    doc = {"rounds": rounds, "summary": summary([row for rnd in rounds for row in rnd["rows"]]),
           "machine": machine.finish().to_dict(), "priority": priority}
    print(json.dumps(doc, indent=2))
    if args.work_dir is not None:
        (args.work_dir / "loop_check.json").write_text(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc)
    return 0


def reanalyse(work_dir: Path) -> dict:
    """Predict every configuration again with this checkout's model, from the runs in `work_dir`: the
    probe's bare spec recalibrated on its kept reference runs, the plans as `fit` chose them (knobs
    kept), the measured profiles as they were. For trying a change to the model on the same runs."""
    sys.path.insert(0, str(ROOT))
    from planner.calibration.calibrate import calibrate
    from planner.calibration.compare import compare
    from planner.calibration.probe_reference import REFERENCE_RUNS
    from planner.sim.report import simulate
    from planner.specs.hardware import NodeSpec
    from planner.specs.plan import load_plan
    from planner.specs.profile import load_profile

    doc = json.loads((work_dir / "loop_check.json").read_text())
    for r, rnd in enumerate(doc["rounds"]):
        work = work_dir / f"r{r}"
        bare = NodeSpec.from_dict(json.loads((work / "probe" / "bare.json").read_text()), "bare spec")
        runs = []
        for ref in REFERENCE_RUNS:
            plan = load_plan(work / "probe" / f"{ref.name}.plan.json").replace(node=bare)
            profiles = sorted((load_profile(p) for p in (work / "probe").glob(f"{ref.name}.*.profile.json")),
                              key=lambda p: p.measured.iteration_time_s)
            runs.append((plan, profiles[(len(profiles) - 1) // 2]))
        node = calibrate(runs, bare).node.replace(name=bare.name)
        rnd["spec"] = node.to_dict()
        for index, row in enumerate(rnd["rows"]):
            index = next(i for i, c in enumerate(CONFIGS) if c[0] == row["config"])
            plan = load_plan(work / f"c{index}.plan.json").replace(node=node, prediction=None)
            plan = plan.replace(prediction=simulate(plan).prediction)
            metrics = {m.metric: m for m in compare(plan, load_profile(work / f"c{index}.profile.json"))}
            for key in ("iteration_time_s", *(f"phase_time_s.{p}" for p in PHASES)):
                m, name = metrics[key], key.removeprefix("phase_time_s.")
                row[name] = {"predicted": m.predicted, "measured": m.measured,
                             "error": (m.predicted - m.measured) / m.measured if m.measured else None}
    doc["summary"] = summary([row for rnd in doc["rounds"] for row in rnd["rows"]])
    return doc


def _cell(entry: dict | None) -> str:
    if not entry:
        return "-"
    return f"{entry['predicted']:.3f} / {entry['measured']:.3f} ({entry['error']:+.0%})"


def write_results(doc: dict, *, reanalysed: bool = False) -> None:
    machine, s = results_md.MachineFacts.from_dict(doc["machine"]), doc["summary"]
    again = (" Predictions made again with this checkout's model from the run's kept reference runs, plans and "
             "profiles (`--reanalyse --write-results`), the measurements as they were.") if reanalysed else ""
    lines = ["## The loop outside the sweep (`benchmarks/loop_check.py`)", "",
             f"`python benchmarks/loop_check.py --rounds {len(doc['rounds'])} --write-results` "
             f"({doc['priority']}). {machine.describe()} "
             "Each round: one `planner probe` (calibrated on its reference runs), then per configuration `planner fit` "
             f"(shape, batch and placement pinned), `planner run --steps {STEPS}` (2 warm-up), `planner compare`. "
             "No configuration is a sweep configuration or a probe reference run." + again, "",
             f"- iteration time: median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}, "
             f"{s['within_15pct']} of {s['count']} within 15% (targets: each within 15%, median within 10%)", "",
             "| round | configuration | ci | iteration s pred / meas (error) | forward | backward | optimizer |",
             "|---|---|---|---|---|---|---|"]
    for r, rnd in enumerate(doc["rounds"]):
        lines += [f"| {r} | {row['config']} | {row['recompute_interval']} | {_cell(row.get('iteration_time_s'))} | "
                  + " | ".join(_cell(row.get(p)) for p in PHASES) + " |" for row in rnd["rows"]]
        lines.append(f"| {r} | (probe: load average {rnd['load_average_at_probe'][0]:.2f}, {rnd['probe_s']:.0f} s) "
                     "| | | | | |")
    results_md.write_section("loop_check", "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
