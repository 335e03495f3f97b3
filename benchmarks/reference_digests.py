"""Losses and training-checkpoint digests of the reference runs, to prove a refactor changed no bit.

Runs `planner run` on tiny plans (1 and 2 ranks, every placement, both optimizer schedules) from the
checkout given by --checkout, and writes one JSON: per case, the loss of every step and the sha256 of
every file of the final training checkpoint. Run it on the commit before a change and on the commit
after, on the same machine, and compare the two files with --compare: floating-point results depend
on the CPU's instruction set, so files from two machines are not comparable.

    python benchmarks/reference_digests.py --checkout . --out after.json
    python benchmarks/reference_digests.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

PLACEMENTS = {
    "device": {"params": "gpu", "gradients": "gpu", "optimizer_states": "gpu", "recompute_inputs": "gpu"},
    "cpu": {"params": "cpu", "gradients": "cpu", "optimizer_states": "cpu", "recompute_inputs": "cpu"},
    "opt-nvme": {"params": "cpu", "gradients": "cpu", "optimizer_states": "nvme", "recompute_inputs": "cpu"},
    "nvme": {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"},
}
OLD_SPELLINGS = {"recompute_interval": "checkpoint_interval", "recompute_inputs": "activation_checkpoints"}
"""New plan key -> the key a checkout from before the recompute renames reads (newer ones read both)."""
SCHEDULES = ("after_backward", "in_backward")
STEPS = 4


def cli_command(checkout: Path) -> list[str]:
    """The checkout's own console-script entry point (it moves when the CLI package moves)."""
    entry = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["scripts"]["planner"]
    module, func = entry.split(":")
    return [sys.executable, "-c", f"import sys; sys.argv[0] = 'planner'; from {module} import {func}; sys.exit({func}())"]


def plan_doc(checkout: Path, *, world: int, placement: dict[str, str], schedule: str, nvme: Path) -> dict:
    hardware = json.loads((checkout / "data" / "hardware" / "cpu-dev-2core.json").read_text())
    if not any("recompute_interval" in p.read_text() for p in checkout.glob("planner/**/plan.py")):
        return _old_spellings(_plan_doc(hardware, world, placement, schedule, nvme))
    return _plan_doc(hardware, world, placement, schedule, nvme)


def _old_spellings(doc: dict) -> dict:
    return {OLD_SPELLINGS.get(k, k): _old_spellings(v) if isinstance(v, dict) else v for k, v in doc.items()}


def _plan_doc(hardware: dict, world: int, placement: dict[str, str], schedule: str, nvme: Path) -> dict:
    return {
        "model": {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "seq_len": 32, "vocab_size": 128},
        "hardware": hardware, "num_gpus": world, "precision": "fp32", "recompute_interval": 1,
        "micro_batch_per_gpu": 2, "placement": placement, "optimizer_step": schedule, "nvme_path": str(nvme),
    }


def run_case(checkout: Path, work: Path, *, world: int, name: str, schedule: str) -> dict:
    case = work / f"{name}-{schedule}-{world}"
    (case / "nvme").mkdir(parents=True)
    plan = case / "plan.json"
    plan.write_text(json.dumps(plan_doc(checkout, world=world, placement=PLACEMENTS[name], schedule=schedule,
                                        nvme=case / "nvme")))
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    cmd = [*cli_command(checkout), "run", str(plan), "--steps", str(STEPS), "--nproc", str(world),
           "--profile-out", str(case / "profile.json"), "--save-every", str(STEPS),
           "--checkpoint-dir", str(case / "ckpt"), "--no-history"]
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    losses = json.loads((case / "profile.json").read_text())["losses"]
    manifests = sorted((case / "ckpt").glob("*/MANIFEST.json"))
    files = json.loads(manifests[-1].read_text())["files"]
    return {"losses": [float(x).hex() for x in losses], "files": {f["name"]: f["sha256"] for f in files}}


def collect(checkout: Path) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("DIGEST_TMP")) as tmp:
        for world in (1, 2):
            for name in PLACEMENTS:
                for schedule in SCHEDULES:
                    key = f"{name}/{schedule}/{world}rank"
                    out[key] = run_case(checkout.resolve(), Path(tmp), world=world, name=name, schedule=schedule)
                    print(key, "error" if "error" in out[key] else "ok", flush=True)
    return out


def compare(before: dict, after: dict) -> int:
    bad = 0
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        same = b == a and b is not None and "error" not in b
        bad += not same
        print(f"{key:32s} {'bitwise equal' if same else 'DIFFERS'}")
    print(f"{len(set(before) | set(after)) - bad} of {len(set(before) | set(after))} cases bitwise equal")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", type=Path, default=Path("."))
    p.add_argument("--out", type=Path)
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = p.parse_args()
    if args.compare:
        return compare(*(json.loads(f.read_text()) for f in args.compare))
    result = collect(args.checkout)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
