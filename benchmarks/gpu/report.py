"""The GPU kit's results: the machine, the stages' JSON merged into one document, and its markdown
section for benchmarks/RESULTS.md.

    python benchmarks/gpu/report.py env                          # the GPU, driver, torch and CUDA, as JSON
    python benchmarks/gpu/report.py junit XML OUT.json           # pytest's JUnit XML -> counts and failures
    python benchmarks/gpu/report.py merge WORKDIR OUT.json       # stage JSONs of WORKDIR -> one document
    python benchmarks/gpu/report.py md RESULTS.json... [--write-results]   # markdown (several calls' files merge)

`run.sh` calls the first two on the GPU machine; `md --write-results` runs here on the fetched
files and replaces the `gpu` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict:
    """The GPU as nvidia-smi and torch see it (nothing here needs the project)."""
    doc: dict = {"python": platform.python_version(), "host": platform.node(), "kernel": platform.release()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        doc["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        doc["nvidia_smi"] = f"unavailable: {exc}"
    try:
        import torch

        doc |= {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            doc |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory,
                    "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count}
    except ImportError as exc:
        doc["torch"] = f"unavailable: {exc}"
    doc["cpu_count"] = os.cpu_count()
    return doc


def merge(workdir: Path, out: Path) -> dict:
    """Every `STAGE.json` of `workdir` under its stage name (later calls on a warm machine add to it)."""
    doc = json.loads(out.read_text()) if out.exists() else {}
    for path in sorted(workdir.glob("*.json")):
        try:
            doc[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            doc[path.stem] = {"ok": False, "error": f"unreadable JSON: {exc}"}
    out.write_text(json.dumps(doc, indent=2))
    return doc


def junit(xml: Path) -> dict:
    """pytest's JUnit XML -> counts and the failing tests' ids."""
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        kind = "failed" if "failure" in kinds else "errors" if "error" in kinds else "skipped" if "skipped" in kinds else "passed"
        counts[kind] += 1
        if kind in ("failed", "errors"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    return counts | {"failures": failures, "ok": counts["passed"] > 0 and not failures}


def _ratios(doc: dict) -> list[str]:
    return [f"| {k} | {v:.3f} |" for k, v in doc.get("ratios", {}).items()]


def _timing(title: str, doc: dict) -> list[str]:
    if not doc.get("ok"):
        return [f"**{title}**: did not run: `{str(doc.get('error', 'no result'))[-300:]}`", ""]
    lines = [f"**{title}** ({doc['model']}; {doc['rounds']} processes x {doc['steps_per_round']} steps after "
             f"{doc['warmup_steps']} warm-up, systems alternating step by step):", "",
             "| system | median step (s) | min step (s) | optimizer |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['median_step_time_s']:.4f} | {v['min_step_time_s']:.4f} | {v.get('optimizer')} |"
              for k, v in doc["summary"].items()]
    return [*lines, "", "| ratio | value |", "|---|---|", *_ratios(doc), ""]


def _nvme(doc: dict) -> list[str]:
    if "configs" not in doc:
        return [f"**NVMe**: did not run: `{str(doc.get('error', 'no result'))[-300:]}`", ""]
    lines = ["**Full NVMe** (`benchmarks/bench_nvme_step.py --device cuda`; its RESULTS section explains the "
             "rooflines): DeepSpeed with " + str(doc["deepspeed"].get("optimizer")) + ", pipelined swapping, best aio "
             f"setting {doc['deepspeed'].get('best') and (doc['deepspeed']['best']['queue_depth'], doc['deepspeed']['best']['threads'])} "
             "(queue depth, threads) of the sweep:", "", "| queue depth | threads | deepspeed median step (s) | ours / deepspeed |",
             "|---|---|---|---|"]
    for e in doc["deepspeed"]["sweep"]:
        lines.append(f"| {e['queue_depth']} | {e['threads']} | " + ("failed | |" if "error" in e else
                     f"{e['deepspeed_median_step_time_s']:.3f} | {e['ours/deepspeed (median of paired ratios)']:.3f} |"))
    for name, cfg in doc["configs"].items():
        lines += ["", f"{name} (batch {cfg['batch']} x {cfg['tokens']}):", "", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in cfg["ratios"].items()]
    return [*lines, ""]


def _planner(doc: dict) -> list[str]:
    lines = ["**planner probe -> fit -> run -> compare** on this GPU:", ""]
    for name, chain in doc.get("chains", {}).items():
        lines.append(f"- `{name}`: {chain.get('summary', chain.get('error', 'no result'))}")
    return [*lines, ""]


def _staged(doc: dict) -> list[str]:
    if not doc.get("ok"):
        return [f"**Staged host copies**: did not run: `{str(doc.get('error', 'no result'))[-300:]}`", ""]
    micro = doc["micro"]
    lines = [f"**Staged host copies** (`benchmarks/gpu/staged_path.py`: {micro['units']} shards of "
             f"{micro['unit_numel']:,} bf16 elements through the runtime's pool, {micro['torch_threads']} torch "
             "threads; best of 3):", "", "| path | GB/s |", "|---|---|"]
    lines += [f"| {k.removesuffix(' GB/s')} | {v} |" for k, v in micro.items() if k.endswith("GB/s")]
    sampled = doc.get("sampled")
    if sampled:
        lines += ["", f"Sampled ({sampled['samples']} samples at 1 ms over {sampled['sampled_steps']} steps of "
                  f"{sampled['placement']}; phases {sampled['phase_time_s']}): each thread's top frames in each phase, "
                  "as shares of all samples:", ""]
        for thread, frames in sampled["threads"].items():
            top = ", ".join(f"`{where}` {share:.0%}" for where, share in list(frames.items())[:8])
            lines.append(f"- {thread}: {top}")
    return [*lines, ""]


def markdown(doc: dict) -> str:
    e = doc.get("env", {})
    gpu = e.get("gpu") or e.get("nvidia_smi", "unknown GPU")
    lines = ["## On a GPU: `bash benchmarks/gpu/run.sh`", "",
             f"GPU: **{gpu}** (nvidia-smi: {e.get('nvidia_smi')}); torch {e.get('torch')}, CUDA {e.get('cuda')}, "
             f"Python {e.get('python')}, {e.get('cpu_count')} CPUs, kernel {e.get('kernel')}. Every ratio is measured "
             "side by side in one process on the same model, batch, precision (fp32) and GPU.", ""]
    if "pytest" in doc:
        p = doc["pytest"]
        lines += [f"`pytest -m gpu`: {p.get('passed', 0)} passed, {p.get('failed', 0)} failed, {p.get('errors', 0)} errors, "
                  f"{p.get('skipped', 0)} skipped" + (": " + ", ".join(p["failures"][:10]) if p.get("failures") else "") + ".", ""]
    if "parity" in doc:
        par = doc["parity"]
        if "systems" in par:
            lines += ["Parity with plain torch (fp32, TF32 off, same weights and batches): " + "; ".join(
                f"`{k}` max relative loss error {v['max_rel_error_vs_plain']:.2e}"
                + (", bitwise equal" if v["bitwise_equal_to_plain"] else "") for k, v in par["systems"].items())
                + f" (tolerance {par['tolerance']:g}).", ""]
        else:
            lines += [f"Parity did not run: `{str(par.get('error'))[-300:]}`", ""]
    if "device" in doc:
        lines += _timing("Everything on the GPU: ours vs plain torch", doc["device"])
    if "offload" in doc:
        lines += _timing("CPU offload: ours vs DeepSpeed ZeRO-3 vs FSDP2 CPUOffloadPolicy", doc["offload"])
    if "nvme" in doc:
        lines += _nvme(doc["nvme"])
    if "planner" in doc:
        lines += _planner(doc["planner"])
    if "staged" in doc:
        lines += _staged(doc["staged"])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"]:
        print(json.dumps(env(), indent=2))
        return 0
    if argv[:1] == ["junit"] and len(argv) == 3:
        Path(argv[2]).write_text(json.dumps(junit(Path(argv[1])), indent=2))
        return 0
    if argv[:1] == ["merge"] and len(argv) == 3:
        merge(Path(argv[1]), Path(argv[2]))
        return 0
    if argv[:1] == ["md"] and len(argv) > 1:
        files = [a for a in argv[1:] if a != "--write-results"]
        doc: dict = {}
        for f in files:
            doc |= json.loads(Path(f).read_text())
        text = markdown(doc)
        print(text)
        if "--write-results" in argv:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            import results_md

            results_md.write_section("gpu", text)
        return 0
    print("usage: report.py env | junit XML OUT.json | merge WORKDIR OUT.json | md RESULTS.json... [--write-results]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
