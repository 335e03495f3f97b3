"""A new user's first hour, scripted: the first-hour checks, then probe, fit a pinned small model,
run it, compare (docs/calibration.md).

    python benchmarks/new_user.py [--rounds 2] [--write-results]

The first-hour checks (`first_hour`, always; their own RESULTS.md section, `new_user_first_hour`)
repeat what a newcomer hits and assert each answer: `planner dashboard` with stdin closed and no
terminal serves the page within DASHBOARD_DEADLINE_S; a Qwen2.5-0.5B config.json with
`tie_word_embedding` or `num_key_value_head` misspelled is refused naming the key and the one meant;
a plan made for a DGX H100 run here prints its first line within FIRST_LINE_DEADLINE_S and a time
left after its first step, and says how far the first step is from the plan's prediction.

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
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
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


DASHBOARD_DEADLINE_S = 30.0
FIRST_LINE_DEADLINE_S = 10.0
QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
            "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rope_theta": 1000000.0,
            "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
"""Qwen/Qwen2.5-0.5B's config.json (494,032,768 parameters as transformers builds it)."""


def check(claim: bool, what: str) -> None:
    if not claim:
        raise SystemExit(f"new_user: {what}")


def dashboard_check(work: Path) -> dict:
    """`planner dashboard` under `< /dev/null`, in a session of its own (no terminal): seconds to HTTP 200."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "HOME": str(work), "BROWSER": "true"}  # no ~/.streamlit: a first start
    log = work / "dashboard.log"
    start = time.monotonic()
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "tierwise", "dashboard", "--port", str(port)], cwd=work,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        served_s = None
        try:
            while served_s is None and time.monotonic() - start < DASHBOARD_DEADLINE_S and server.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as reply:
                        served_s = time.monotonic() - start if reply.status == 200 else None
                except OSError:
                    time.sleep(0.25)
        finally:
            server.terminate()
            server.wait(timeout=30)
    check(served_s is not None, f"the dashboard did not serve within {DASHBOARD_DEADLINE_S:.0f} s: "
                                f"{log.read_text()[-500:]}")
    check(f"http://127.0.0.1:{port}" in log.read_text(), "the dashboard did not print its address")
    return {"dashboard_served_s": served_s}


def misspelled_key_check(work: Path) -> dict:
    out = {}
    for key, wrong in (("tie_word_embeddings", "tie_word_embedding"), ("num_key_value_heads", "num_key_value_head")):
        path = Path(f"{wrong}.json")  # relative to `work`, where it runs: the answer names no temporary path
        (work / path).write_text(json.dumps({(wrong if k == key else k): v for k, v in QWEN_05B.items()}))
        done = subprocess.run([sys.executable, "-m", "tierwise", "fit", str(path), "--gpus", "8"], cwd=work,
                              capture_output=True, text=True)
        said = f"unknown key {wrong!r} in model file {path} (qwen2): did you mean {key!r}?"
        check(done.returncode == 1 and said in done.stderr, f"{wrong}: {done.stderr.strip()[-300:]}")
        out[wrong] = done.stderr.strip()
    return out


def foreign_plan_check(work: Path) -> dict:
    """A tiny model planned for a DGX H100, run here: its first line, then the time left after step 1."""
    plan = work / "foreign.json"
    planner("fit", "--layers", "2", "--hidden", "128", "--heads", "2", "--seq", "64", "--vocab", "256", "--gpus", "1",
            "--hardware", "dgx-h100", "--batch-per-gpu", "1",
            "--placement", "params=gpu,gradients=gpu,optimizer_states=gpu,recompute_inputs=gpu", "--out", str(plan))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tierwise", "run", plan.name, "--steps", "3", "--no-history"],
                            cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    lines, first_line_s, eta_s = [], None, None
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        first_line_s = first_line_s if first_line_s is not None else time.monotonic() - start
        if eta_s is None and line.startswith("step 1/") and line.rstrip().endswith(" left"):
            eta_s = time.monotonic() - start
    check(proc.wait() == 0, "the foreign plan did not run: " + " | ".join(lines[-5:]))
    check(first_line_s is not None and first_line_s <= FIRST_LINE_DEADLINE_S,
          f"the first progress line came after {first_line_s} s")
    check(eta_s is not None, "no time left after the first step: " + " | ".join(lines))
    slow = next((line for line in lines if line.startswith("warning: the first step took")), "")
    return {"first_line_s": first_line_s, "eta_after_s": eta_s, "slow_warning": slow, "lines": lines}


def first_hour(work: Path) -> dict:
    return {**dashboard_check(work), "misspelled": misspelled_key_check(work), "foreign": foreign_plan_check(work)}


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
    ap.add_argument("--rounds", type=int, default=2, help="probe-fit-run-compare rounds after the first-hour checks")
    ap.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    machine = results_md.measure_machine(torch=True)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tierwise-new-user-") as tmp:
        hour = first_hour(Path(tmp))
        print(f"first hour: dashboard served in {hour['dashboard_served_s']:.1f} s, first run line after "
              f"{hour['foreign']['first_line_s']:.1f} s, time left after {hour['foreign']['eta_after_s']:.1f} s",
              file=sys.stderr)
        if args.write_results:
            write_first_hour(hour, machine)
        for r in range(args.rounds):
            work = Path(tmp) / f"r{r}"
            work.mkdir()
            rounds.append(one_round(work, args.nvme_path or tmp))
            print(f"round {r}: " + ", ".join(f"{row['error']:+.1%}" for row in rounds[-1]), file=sys.stderr)
    if not rounds:
        print(json.dumps({"first_hour": hour}, indent=2))
        return 0
    errors = sorted(abs(row["error"]) for rows in rounds for row in rows)
    doc = {"first_hour": hour, "rounds": rounds, "median_abs_error": statistics.median(errors),
           "worst_abs_error": errors[-1], "machine": machine.finish().to_dict()}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc, machine)
    return 0


def write_first_hour(hour: dict, machine: results_md.MachineFacts) -> None:
    foreign = hour["foreign"]
    lines = ["## A new user's first hour (`benchmarks/new_user.py`)", "",
             f"`python benchmarks/new_user.py --write-results`. {machine.finish().describe()} Each check asserts "
             "its answer:", "",
             "| check | answer |", "|---|---|",
             f"| `planner dashboard < /dev/null`, no terminal, no ~/.streamlit | HTTP 200 after "
             f"{hour['dashboard_served_s']:.1f} s (deadline {DASHBOARD_DEADLINE_S:.0f} s) |"]
    lines += [f"| Qwen2.5-0.5B config.json with `{wrong}` | `{said}` |" for wrong, said in hour["misspelled"].items()]
    lines += [f"| a DGX H100 plan of a tiny model, `planner run --steps 3` here | first line after "
              f"{foreign['first_line_s']:.1f} s (deadline {FIRST_LINE_DEADLINE_S:.0f} s); time left printed "
              f"{foreign['eta_after_s']:.1f} s in |",
              f"| ... its first step against the plan | `{foreign['slow_warning'] or 'no warning (within 3x)'}` |", "",
              "`planner run`'s lines for the DGX H100 plan:", "", "```", *foreign["lines"], "```"]
    results_md.write_section("new_user_first_hour", "\n".join(lines))


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
