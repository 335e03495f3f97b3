"""Planning for the machine you sit at: `fit --hardware local`, `planner run`, `planner compare`.

With a cache directory of its own (so the first `fit` probes: runtime/local_hardware.py) the script
plans the tiny model `fit --layers 4 --hidden 512 --heads 8 --seq 256 --vocab 256 --gpus 1
--hardware local` in its default precision (fp32 where the machine emulates bf16: planner/specs/
precision.py [Note: emulated precisions]), fits it again (the cache), trains the plan for `--steps`
steps and compares the predicted iteration time with the measured one. Target: within 25 %.

    python benchmarks/local_hardware.py --write-results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--layers", "4", "--hidden", "512", "--heads", "8", "--seq", "256", "--vocab", "256", "--gpus", "1"]
TARGET = 0.25


def planner(*args: str, env: dict[str, str]) -> tuple[str, str, float]:
    """stdout, stderr and wall seconds of one `planner` command (exits on a failure)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tierwise", *args], cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"planner {args[0]} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout, done.stderr, time.perf_counter() - started


def one_round(work: Path, steps: int) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=str(work / "cache"))
    plan, profile = work / "plan.json", work / "run.json"
    _, probed_line, probe_s = planner("fit", *TINY, "--hardware", "local", "--out", str(plan), env=env)
    _, cached_line, cached_s = planner("fit", *TINY, "--hardware", "local", "--out", str(plan), env=env)
    planner("run", str(plan), "--steps", str(steps), "--profile-out", str(profile), "--no-history", env=env)
    metrics = {m["metric"]: m for m in json.loads(planner("compare", str(plan), str(profile), "--json",
                                                          env=env)[0])["metrics"]}
    cache = json.loads(next((work / "cache").rglob("local-hardware.json")).read_text())
    plan_doc = json.loads(plan.read_text())
    row = {"precision": plan_doc["precision"], "batch_per_gpu": plan_doc["micro_batch_per_gpu"],
           "fit_with_probe_s": probe_s, "fit_from_cache_s": cached_s,
           "stderr_probe": probed_line.strip().splitlines(), "stderr_cached": cached_line.strip().splitlines(),
           "precision_rates": cache["hardware"]["precision_rates"],
           "compute_precision": cache["hardware"]["compute_precision"]}
    for metric in ("iteration_time_s", "phase_time_s.forward", "phase_time_s.backward", "phase_time_s.optimizer"):
        m = metrics[metric]
        row[metric] = {"predicted": m["predicted"], "measured": m["measured"],
                       "error": (m["predicted"] - m["measured"]) / m["measured"]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    machine = results_md.measure_machine(torch=True)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tierwise-local-") as tmp:
        for r in range(args.rounds):
            work = Path(tmp) / f"r{r}"
            work.mkdir()
            rounds.append(one_round(work, args.steps))
            print(f"round {r}: iteration {rounds[-1]['iteration_time_s']['error']:+.1%}", file=sys.stderr)
    doc = {"rounds": rounds, "steps": args.steps, "machine": machine.finish().to_dict()}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc, machine)
    return 0


def write_results(doc: dict, machine: results_md.MachineFacts) -> None:
    lines = ["## Planning for this machine (`benchmarks/local_hardware.py`)", "",
             f"`python benchmarks/local_hardware.py --rounds {len(doc['rounds'])} --steps {doc['steps']} "
             f"--write-results`. {machine.describe()} Each round, with an empty cache: `planner fit {' '.join(TINY)} "
             "--hardware local` (probes), the same again (reads the cache), `planner run --steps "
             f"{doc['steps']}`, `planner compare`. Target: iteration time within {TARGET:.0%}.", "",
             "| round | precision | batch | fit + probe s | fit from cache s | iteration predicted s | measured s | error "
             "| forward error | backward error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r, row in enumerate(doc["rounds"]):
        it = row["iteration_time_s"]
        lines.append(f"| {r} | {row['precision']} | {row['batch_per_gpu']:g} | {row['fit_with_probe_s']:.0f} | "
                     f"{row['fit_from_cache_s']:.1f} | {it['predicted']:.3f} | {it['measured']:.3f} | {it['error']:+.1%} | "
                     f"{row['phase_time_s.forward']['error']:+.1%} | {row['phase_time_s.backward']['error']:+.1%} |")
    last = doc["rounds"][-1]
    rates = ", ".join(f"{p} {r['matmul_tflops'] * 1e3:.3g} / {r['backward_matmul_tflops'] * 1e3:.3g}"
                      for p, r in sorted(last["precision_rates"].items()))
    lines += ["", f"Measured matmul rates, forward / backward GFLOP/s (last round): {rates}; the spec states its rates "
              f"in {last['compute_precision']}. What `fit` said (last round):", ""]
    lines += [f"    {line}" for line in last["stderr_probe"] + last["stderr_cached"]]
    results_md.write_section("local_hardware", "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
