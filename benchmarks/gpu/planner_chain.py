"""`planner probe` -> `planner fit` -> `planner run` -> `planner compare` on this machine, through the
`planner` console script (whatever module it points to), for the kit's Llama in the plans of CHAINS.

    python benchmarks/gpu/planner_chain.py --work DIR [--nvme-path DIR] [--profile gpu|dry] [--chains cpu,nvme]
                                           [--hardware SPEC] [--out planner.json]

One probe (none with `--hardware`: the dry run fits on the CPU preset, `planner probe` taking minutes
on a small shared CPU machine); then per chain, in order and while the stage has time for it
(GPUKIT_DEADLINE, [Note: results survive a cut] in call.py), a plan fitted to the probed hardware
for the model and first shape that bench_llama.py measures in the same tier (the 1.1 B Llama for the
host and device plans, its 4-layer cut for NVMe), a short `planner run --model` of it, and the
comparison of the plan's prediction with the run's profile, phase by phase. The document is
published after each chain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_llama import SIZINGS, deadline_left_s, model_config, publish
from kit import emit

CHAINS = {
    "cpu": (["--strategy", "zero-inf-cpu"], "offload", 4),
    "nvme": (["--strategy", "zero-inf-nvme"], "nvme", 3),
    "device": (["--placement", "params=gpu,gradients=gpu,optimizer_states=gpu,recompute_inputs=gpu"], "offload", 4),
}
"""Chain -> (what `fit` is pinned to, the bench_llama mode whose model and first shape it plans, steps
run). In the order the must-show needs them: the host and NVMe plans first, the device plan if time is left."""
PROBE_S = 30
"""Seconds kept for a chain that has not run yet when deciding whether it still fits."""


def planner(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    exe = shutil.which("planner")
    if exe is None:
        raise SystemExit("the `planner` console script is not on PATH: run the kit's install stage first")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s)


def model_file(mode: str, profile: str, work: Path) -> tuple[Path, list[str]]:
    """The chain's Hugging Face config written to `work`, and fit's shape options for its first shape."""
    sizing = SIZINGS[(mode, profile)]
    path = work / f"model-{mode}-{profile}.json"
    path.write_text(json.dumps(model_config(sizing.overrides), indent=2))
    shape = sizing.shapes[0]
    return path, ["--seq", str(shape.seq), "--batch-per-gpu", str(shape.batch)]


def chain(name: str, hardware: Path, work: Path, nvme_path: str, profile: str, steps: int | None = None) -> dict:
    pins, mode, default_steps = CHAINS[name]
    config, shape = model_file(mode, profile, work)
    plan, profile_out = work / f"plan-{name}.json", work / f"profile-{name}.json"
    fit = planner("fit", str(config), *shape, "--gpus", "1", "--hardware", str(hardware), "--precision", "bf16",
                  "--nvme-path", nvme_path, *pins, "--out", str(plan), "--json")
    if fit.returncode or not plan.exists():
        return {"error": f"fit: {(fit.stderr or fit.stdout)[-1500:]}"}
    plan_doc = json.loads(plan.read_text())
    pred = plan_doc.get("prediction", {})
    if not pred.get("feasible", True):
        return {"plan": plan_doc, "summary": "infeasible on this machine (fit's answer)"}
    start = time.perf_counter()
    run = planner("run", str(plan), "--model", str(config), "--steps", str(steps or default_steps),
                  "--profile-out", str(profile_out), "--no-history")
    run_s = time.perf_counter() - start
    if run.returncode or not profile_out.exists():
        return {"plan": plan_doc, "error": f"run: {(run.stderr or run.stdout)[-2500:]}"}
    compare = planner("compare", str(plan), str(profile_out), "--json")
    out = {"placement": plan_doc.get("placement"), "prediction": pred, "run_wall_s": run_s,
           "profile": json.loads(profile_out.read_text()), "compare_rc": compare.returncode}
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
    ap.add_argument("--profile", choices=("gpu", "dry"), default="gpu")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: each chain's)")
    ap.add_argument("--chains", default=",".join(CHAINS))
    ap.add_argument("--hardware", type=Path, help="a hardware spec file or preset to use instead of probing this machine")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    hardware = args.hardware or args.work / "hw.json"
    probe = None if args.hardware else planner("probe", "--out", str(hardware), "--nvme-path", args.nvme_path)
    doc: dict = {"probed": probe is not None, "profile": args.profile, "chains": {}, "skipped_chains": [],
                 "ok": False, "partial": True}
    if probe is not None and (probe.returncode or not hardware.exists()):
        return emit(doc | {"error": f"probe: {(probe.stderr or probe.stdout)[-2500:]}"}, args.out)
    doc["hardware"] = json.loads(hardware.read_text()) if hardware.is_file() else str(hardware)
    last_s = PROBE_S
    for name in args.chains.split(","):
        if doc["chains"] and last_s * 1.1 > deadline_left_s():
            doc["skipped_chains"].append(name)
            continue
        began = time.perf_counter()
        doc["chains"][name] = chain(name, hardware, args.work, args.nvme_path, args.profile, args.steps)
        last_s = time.perf_counter() - began
        publish(doc, args.out, "planner")
    doc["ok"] = bool(doc["chains"]) and all("error" not in c for c in doc["chains"].values())
    doc["partial"] = bool(doc["skipped_chains"])
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
