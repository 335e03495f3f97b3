"""`planner probe` -> `planner fit` -> `planner run` -> `planner compare` on this machine, through the
`planner` console script (whatever module it points to), for a model and placements of CHAINS.

    python benchmarks/gpu/planner_chain.py --work DIR [--nvme-path DIR] [--steps N] [--chains a,b] [--out planner.json]

One probe; then per chain a plan fitted to the probed hardware, a short run of it and the comparison
of the plan's prediction with the run's profile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kit import emit

MODEL = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--vocab", "0", "--batch-per-gpu", "4"]
"""A 1.2 B-parameter GPT: its full-NVMe step moves about 20 GB, seconds on one drive."""
CHAINS = {"searched": ([], 5), "zero-inf-cpu": (["--strategy", "zero-inf-cpu"], 5),
          "zero-inf-nvme": (["--strategy", "zero-inf-nvme"], 3)}
"""Chain -> (what `fit` is pinned to, steps run). Searched: the planner's own choice (all on the GPU
for this model); full NVMe: 3 steps, its plan predicts about 28 s each on a probed
one-GPU H100 or H200 machine."""


def planner(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    exe = shutil.which("planner")
    if exe is None:
        raise SystemExit("the `planner` console script is not on PATH: run the kit's install stage first")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s)


def chain(name: str, pins: list[str], hardware: Path, work: Path, nvme_path: str, steps: int,
          model: list[str] = MODEL) -> dict:
    plan, profile = work / f"plan-{name}.json", work / f"profile-{name}.json"
    fit = planner("fit", *model, "--gpus", "1", "--hardware", str(hardware), "--precision", "bf16",
                  "--nvme-path", nvme_path, *pins, "--out", str(plan), "--json")
    if fit.returncode or not plan.exists():
        return {"error": f"fit: {(fit.stderr or fit.stdout)[-1500:]}"}
    plan_doc = json.loads(plan.read_text())
    pred = plan_doc.get("prediction", {})
    if not pred.get("feasible", True):
        return {"plan": plan_doc, "summary": "infeasible on this machine (fit's answer)"}
    start = time.perf_counter()
    run = planner("run", str(plan), "--steps", str(steps), "--profile-out", str(profile), "--no-history")
    run_s = time.perf_counter() - start
    if run.returncode or not profile.exists():
        return {"plan": plan_doc, "error": f"run: {(run.stderr or run.stdout)[-2500:]}"}
    compare = planner("compare", str(plan), str(profile), "--json")
    out = {"placement": plan_doc.get("placement"), "prediction": pred, "run_wall_s": run_s,
           "profile": json.loads(profile.read_text()), "compare_rc": compare.returncode}
    try:
        out["compare"] = json.loads(compare.stdout)
    except json.JSONDecodeError:
        out["compare_error"] = (compare.stderr or compare.stdout)[-1500:]
    measured = out["profile"].get("measured", {}).get("iteration_time_s")
    out["summary"] = (f"placement {plan_doc.get('placement')}: predicted {pred.get('iteration_time_s')} s per "
                      f"iteration, measured {measured} s" + ("" if out.get("compare") else "; compare failed"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--nvme-path", default="/tmp/gpukit-nvme")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: each chain's)")
    ap.add_argument("--chains", default=",".join(CHAINS))
    ap.add_argument("--hardware", type=Path, help="a hardware spec to use instead of probing this machine")
    ap.add_argument("--model", default=" ".join(MODEL), help="fit's model options (default: %(default)s)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    hardware = args.hardware or args.work / "hw.json"
    probe = None if args.hardware else planner("probe", "--out", str(hardware), "--nvme-path", args.nvme_path)
    doc: dict = {"probed": probe is not None, "chains": {}}
    if probe is not None and (probe.returncode or not hardware.exists()):
        doc |= {"ok": False, "error": f"probe: {(probe.stderr or probe.stdout)[-2500:]}"}
    else:
        doc["hardware"] = json.loads(hardware.read_text())
        for name in args.chains.split(","):
            pins, steps = CHAINS[name]
            doc["chains"][name] = chain(name, pins, hardware, args.work, args.nvme_path, args.steps or steps,
                                        args.model.split())
            if args.out:  # the chains so far survive a stage killed at its time limit
                args.out.write_text(json.dumps(doc | {"ok": False, "partial": True}, indent=2))
        doc["ok"] = all("error" not in c for c in doc["chains"].values())
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
