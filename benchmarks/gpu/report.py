"""The GPU kit's results: the machine, the stages' JSON merged into one document as each stage
ends, the must-shows read off it (met / not met, with the numbers), and its markdown section for
benchmarks/RESULTS.md.

    python benchmarks/gpu/report.py env                          # the GPU, driver, torch and CUDA, as JSON
    python benchmarks/gpu/report.py junit XML OUT.json [--no-gpu]   # pytest's JUnit XML -> counts and failures
    python benchmarks/gpu/report.py publish OUTDIR STAGE FILE    # one stage's JSON into OUTDIR's results
    python benchmarks/gpu/report.py md RESULTS.json... [--write-results]   # markdown; several calls merge (`merge`)

On the GPU machine `call.py` and the stages publish into OUT ([Note: results survive a cut] in
call.py); here, `md --write-results` on the fetched gpu-results.json files replaces the `gpu`
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

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


RESULTS_JSON, RESULTS_MD = "gpu-results.json", "gpu-results.md"


def publish(out: Path, stage: str, doc: dict) -> dict:
    """`doc` as `stage` in OUT/gpu-results.json (replaced atomically: a cut leaves the last whole
    file) and OUT/gpu-results.md written again from all of it; returns the whole document."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_JSON
    try:
        whole = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        whole = {}
    whole[stage] = doc
    _write_atomic(path, json.dumps(whole, indent=2))
    try:
        text = markdown(whole)
    except Exception as exc:  # a rendering fault must not lose the JSON, nor stop the stage that published
        text = f"(report.py could not render these results: {type(exc).__name__}: {exc})\n"
    _write_atomic(out / RESULTS_MD, text)
    return whole


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def junit(xml: Path, *, no_gpu: bool = False) -> dict:
    """pytest's JUnit XML -> counts and the failing tests' ids; ok when some passed and none failed
    (`no_gpu`, the dry run: when none failed, every gpu test being skipped there)."""
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        kind = "failed" if "failure" in kinds else "errors" if "error" in kinds else "skipped" if "skipped" in kinds else "passed"
        counts[kind] += 1
        if kind in ("failed", "errors"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    return counts | {"failures": failures, "no_gpu": no_gpu, "ok": (counts["passed"] > 0 or no_gpu) and not failures}


RATIO = "{} / {} step time (median of paired ratios)"
"""The key of a paired step-time ratio in a shape's `ratios` (benchmarks/gpu/bench_llama.py)."""
GPU_SHARE = "ours-cpu throughput / all-on-GPU throughput (the faster of ours-gpu and plain)"
ROOFLINE = "ours-nvme step / adjacent NVMe roofline"
PROBED_ROOFLINE = "ours-nvme step / NVMe roofline at the probed read and write rates"
PHASE_TOLERANCE = 0.15
"""The planner's per-phase prediction within 15 % of the run (the must-show)."""
PLANNER_CHAINS = ("cpu", "nvme", "device")
"""The plans the planner must-show covers (benchmarks/gpu/planner_chain.py's CHAINS)."""


class MustShow(NamedTuple):
    claim: str
    target: str
    measured: str
    met: bool | None
    """None: not measured in these results."""


def not_measured(doc: dict, *systems: str) -> str:
    """Why a must-show read off `doc` has no number: a system left out (its reason), the stage's own
    error, or plainly not measured."""
    why = next((doc["left_out"][s] for s in systems if s in doc.get("left_out", {})), None)
    if why is None and doc.get("error"):
        why = first_error_line(str(doc["error"]))
    return "not measured" if why is None else "not measured: " + why.removeprefix("not measured: ")


def first_error_line(text: str) -> str:
    """The line of a long error that says what went wrong (`XError: ...`), else its first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    return (errors[-1] if errors else lines[0] if lines else text)[:300]


def _per_shape(doc: dict, key: str, bound: float, *, at_most: bool = True) -> tuple[str, bool | None]:
    values = {name: shape["ratios"][key] for name, shape in doc.get("shapes", {}).items() if key in shape.get("ratios", {})}
    if not values:
        systems = key.split(" step time")[0].split(" throughput")[0].split(" / ")
        return not_measured(doc, *reversed(systems)), None
    met = all(v <= bound if at_most else v >= bound for v in values.values())
    return "; ".join(f"{v:.3f} at {name}" for name, v in values.items()), met


def _at_seq(doc: dict, seq: int, key: str, bound: float) -> tuple[str, bool | None]:
    shapes = {n: s for n, s in doc.get("shapes", {}).items() if s.get("seq") == seq and key in s.get("ratios", {})}
    return _per_shape({**doc, "shapes": shapes}, key, bound, at_most=False)


def _roofline(doc: dict) -> tuple[str, bool | None]:
    values = {n: s[ROOFLINE]["median"] for n, s in doc.get("shapes", {}).items() if ROOFLINE in s}
    if not values:
        return not_measured(doc, "ours-nvme"), None
    return "; ".join(f"{v:.3f} at {n}" for n, v in values.items()), all(v <= 1.2 for v in values.values())


def phase_errors(chain: dict) -> dict[str, float]:
    """Phase -> relative error of the prediction (planner compare's rows `phase_time_s.*` with a time)."""
    rows = chain.get("compare", {}).get("metrics", [])
    return {r["metric"].split(".", 1)[1]: r["relative_error"] for r in rows
            if r["metric"].startswith("phase_time_s.") and r.get("relative_error") is not None and r.get("measured")}


def _planner_show(doc: dict) -> tuple[str, bool | None]:
    chains = {n: phase_errors(c) for n, c in doc.get("chains", {}).items() if phase_errors(c)}
    if not chains:
        return "not measured", None
    text = "; ".join(f"{n}: " + ", ".join(f"{p} {e:+.0%}" for p, e in errs.items()) for n, errs in chains.items())
    met = all(abs(e) <= PHASE_TOLERANCE for errs in chains.values() for e in errs.values())
    if set(chains) >= set(PLANNER_CHAINS) or not met:
        return text, met
    return text + f" (of {', '.join(PLANNER_CHAINS)}: {', '.join(c for c in PLANNER_CHAINS if c not in chains)} not measured)", None


def must_shows(doc: dict) -> list[MustShow]:
    """The GPU must-shows, each met / not met / not measured, with the numbers it was read from."""
    off, nvme = doc.get("offload", {}), doc.get("nvme", {})
    rows = [("host-memory tier step vs FSDP2 CPUOffloadPolicy", "<= 0.8x",
             _per_shape(off, RATIO.format("ours-cpu", "fsdp2-cpu"), 0.8)),
            ("host-memory tier step vs DeepSpeed ZeRO-3 CPU offload", "<= 0.8x",
             _per_shape(off, RATIO.format("ours-cpu", "deepspeed-cpu"), 0.8)),
            # The same tier with the fp32 master as the host parameter shard (host_param_shard: master), which
            # fit picks where the bill allows: measured beside the compute-width shard in the same process.
            ("host-memory tier, fp32 master as the host shard, step vs FSDP2 CPUOffloadPolicy", "<= 0.8x",
             _per_shape(off, RATIO.format("ours-cpu-master", "fsdp2-cpu"), 0.8)),
            ("host-memory tier, fp32 master as the host shard, step vs DeepSpeed ZeRO-3 CPU offload", "<= 0.8x",
             _per_shape(off, RATIO.format("ours-cpu-master", "deepspeed-cpu"), 0.8)),
            ("host-memory tier throughput vs all-on-GPU, seq 4096", ">= 0.5x", _at_seq(off, 4096, GPU_SHARE, 0.5)),
            ("NVMe tier step vs DeepSpeed ZeRO-Infinity", "<= 0.6x",
             _per_shape(nvme, RATIO.format("ours-nvme", "deepspeed-nvme"), 0.6)),
            ("NVMe tier step vs its NVMe roofline", "<= 1.2x", _roofline(nvme)),
            ("planner probe -> fit -> run -> compare, per phase", "within 15 %", _planner_show(doc.get("planner", {})))]
    shows = [MustShow(claim, target, *got) for claim, target, got in rows]
    p = doc.get("pytest")
    if p is None or "passed" not in p:
        shows.append(MustShow("pytest -m gpu", "all pass", "not run", None))
    elif p.get("no_gpu"):
        shows.append(MustShow("pytest -m gpu", "all pass", f"no GPU: {p['skipped']} skipped, {p['failed']} failed", None))
    else:
        shows.append(MustShow("pytest -m gpu", "all pass", f"{p['passed']} passed, {p['failed']} failed, "
                              f"{p['errors']} errors", p["passed"] > 0 and not p["failed"] and not p["errors"]))
    return shows


def _must_show_table(doc: dict) -> list[str]:
    dry = (" (a dry run on the CPU: these numbers check the kit and measure nothing)"
           if any(k.get("dry_run") for k in doc.get("calls") or [doc.get("kit", {})]) else "")
    lines = [f"**Must-shows** (read off the results below){dry}:", "", "| claim | target | measured | met |",
             "|---|---|---|---|"]
    word = {True: "met", False: "**not met**", None: "not measured"}
    lines += [f"| {m.claim} | {m.target} | {m.measured} | {word[m.met]} |" for m in must_shows(doc)]
    return [*lines, ""]


def _one_call(kit: dict) -> str:
    ran = ", ".join(f"{s} {r['status']} {r['seconds']:.0f} s (planned {kit['expected_h200_s'].get(s, '?')})"
                    for s, r in kit.get("ran", {}).items())
    skipped = ", ".join(kit.get("skipped", [])) or "none"
    return (f"({'dry run on the CPU, ' if kit.get('dry_run') else ''}budget {kit['budget_s']:.0f} s, "
            f"{kit.get('elapsed_s', 0):.0f} s used): {ran or 'no stage ran'}; skipped for time: {skipped}")


def _calls(doc: dict) -> list[str]:
    """The call, or each of several calls (`merge`) with the stages whose results are its."""
    calls = doc.get("calls") or ([doc["kit"]] if "kit" in doc else [])
    if len(calls) == 1:
        return [f"**The call** {_one_call(calls[0])}.", ""]
    lines = [f"**The calls** ({len(calls)}; each stage's result below is from the last call that ran it with a "
             "result):", ""]
    for i, kit in enumerate(calls, 1):
        used = [s for s, c in doc.get("from_call", {}).items() if c == i]
        lines.append(f"{i}. {_one_call(kit)}; results used from it: {', '.join(used) or 'none'}.")
    return [*lines, ""]


def has_result(stage_doc: dict) -> bool:
    """A stage's own document, not the call's note that the stage left none (call.stage_doc)."""
    return not stage_doc.get("no_result") and not str(stage_doc.get("error", "")).startswith("no result")


def merge(calls: list[dict]) -> dict:
    """Several calls' gpu-results.json as one document: each stage's result from the last call that ran
    it with a result (a call whose stage left none keeps an earlier call's), `env` from the last call,
    every call's `kit` record in `calls` and the call each stage's result came from in `from_call`."""
    doc: dict = {"calls": [], "from_call": {}}
    for i, results in enumerate(calls, 1):
        if "kit" in results:
            doc["calls"].append(results["kit"])
        for stage, result in results.items():
            if stage == "kit":
                continue
            if stage == "env" or has_result(result) or stage not in doc:
                doc[stage] = result
                doc["from_call"][stage] = i
    doc["from_call"].pop("env", None)
    if len(doc["calls"]) == 1:
        doc["kit"] = doc["calls"][0]
    return doc


def _did_not_run(title: str, doc: dict) -> list[str]:
    return [f"**{title}**: did not run: `{str(doc.get('error', 'no result'))[-300:]}`", ""]


def _shapes(title: str, doc: dict) -> list[str]:
    if "summary" in doc and "shapes" not in doc:  # a run of the kit before the Llama (runs/2026-11-26-h200.json)
        return _timing(title, doc)
    if not doc.get("shapes"):
        return _did_not_run(title, doc)
    lines = [f"**{title}** ({doc['model']}; {doc['warmup_steps']} warm-up + {doc['measured_steps']} measured steps, "
             "systems alternating step by step in one process):", ""]
    if doc.get("build_errors"):
        lines += ["Not built: " + "; ".join(f"`{n}`: {e[-200:]}" for n, e in doc["build_errors"].items()), ""]
    if doc.get("left_out"):
        lines += ["Left out: " + "; ".join(f"`{n}`: {why}" for n, why in doc["left_out"].items()), ""]
    for name, shape in doc["shapes"].items():
        if shape.get("failed"):
            lines += [f"{name}: failed: " + "; ".join(f"`{n}`: {e[-200:]}" for n, e in shape["failed"].items()), ""]
        lines += [f"{name}:", "", "| system | median step (s) | min step (s) | tokens/s | optimizer |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['median_step_time_s']:.4f} | {v['min_step_time_s']:.4f} | {v['tokens_per_s']:,.0f} | "
                  f"{v.get('optimizer')} |" for k, v in shape["summary"].items()]
        lines += ["", "| ratio | value |", "|---|---|", *[f"| {k} | {v:.3f} |" for k, v in shape["ratios"].items()]]
        if ROOFLINE in shape:
            moved = shape["nvme_bytes_per_step"]
            lines.append(f"| {ROOFLINE} (median over the measured steps; each step's probe right after it) | "
                         f"{shape[ROOFLINE]['median']:.3f} |")
            if PROBED_ROOFLINE in shape:
                lines.append(f"| {PROBED_ROOFLINE} (bytes read / read rate + bytes written / write rate, "
                             f"{shape[PROBED_ROOFLINE]['roofline_s']:.3f} s) | {shape[PROBED_ROOFLINE]['median']:.3f} |")
            lines += ["", f"Our step moves {_size(moved['read'])} read + {_size(moved['write'])} written on NVMe."]
        lines.append("")
    if doc.get("skipped_shapes"):
        lines += [f"Shapes left out for time: {', '.join(doc['skipped_shapes'])}.", ""]
    return lines


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def _timing(title: str, doc: dict) -> list[str]:
    if not doc.get("ok"):
        return _did_not_run(title, doc)
    lines = [f"**{title}** ({doc['model']}; {doc['rounds']} processes x {doc['steps_per_round']} steps after "
             f"{doc['warmup_steps']} warm-up, systems alternating step by step):", "",
             "| system | median step (s) | min step (s) | optimizer |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['median_step_time_s']:.4f} | {v['min_step_time_s']:.4f} | {v.get('optimizer')} |"
              for k, v in doc["summary"].items()]
    return [*lines, "", "| ratio | value |", "|---|---|", *[f"| {k} | {v:.3f} |" for k, v in doc.get("ratios", {}).items()], ""]


def _planner(doc: dict) -> list[str]:
    lines = ["**planner probe -> fit -> run -> compare** on this GPU (relative error of each phase's prediction):", ""]
    for name, chain in doc.get("chains", {}).items():
        errs = phase_errors(chain)
        said = ", ".join(f"{p} {e:+.1%}" for p, e in errs.items())
        lines.append(f"- `{name}`: {chain.get('summary', chain.get('error', 'no result'))}" + (f"; {said}" if said else ""))
    if doc.get("skipped_chains"):
        lines.append(f"- left out for time: {', '.join(doc['skipped_chains'])}")
    return [*lines, ""]


def _staged(doc: dict) -> list[str]:
    if not doc.get("ok"):
        return _did_not_run("Staged host copies", doc)
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


def _build(doc: dict) -> list[str]:
    if "aio_ext" not in doc and "deepspeed" not in doc:
        return _did_not_run("Build", doc)
    ext, ds = doc.get("aio_ext", {}), doc.get("deepspeed", {})
    said = [f"runtime._aio_ext {ext.get('how', 'failed')}" + (f" (io_uring {'yes' if ext.get('io_uring') else 'no'})"
                                                              if ext.get("ok") else ""),
            f"DeepSpeed's {', '.join(ds.get('probe', {}).get('ops', {})) or 'ops'} "
            + (f"{ds.get('how', 'not built')}" if ds.get("ok") else "not ready")
            + (f" after {ds['seconds']:.0f} s" if ds.get("seconds") else "")
            + (f" (TORCH_CUDA_ARCH_LIST={ds['arch_list']})" if ds.get("arch_list") else "")]
    if ds.get("cpu_comm"):
        said.append(f"the CPU accelerator's shm_comm op {'built' if ds['cpu_comm']['ok'] else 'failed'} in "
                    f"{ds['cpu_comm']['seconds']:.0f} s")
    if ds.get("op_seconds"):
        said.append("seconds per op: " + ", ".join(f"{op} {t:.0f}" for op, t in ds["op_seconds"].items()))
    if ds.get("error"):  # the cause; the ops it left unbuilt follow from it
        said.append(f"the build failed: {first_error_line(ds['error'])}")
    elif ds.get("problems"):
        said.append("; ".join(ds["problems"]))
    if doc.get("partial"):
        said.append("stopped at its limit while building")
    if ext.get("error"):
        said.append(first_error_line(ext["error"]))
    return [f"**Build**: {'; '.join(said)}.", ""]


def _checks(doc: dict) -> list[str]:
    lines = []
    if "pytest" in doc:
        p = doc["pytest"]
        lines += [f"`pytest -m gpu`: {p.get('passed', 0)} passed, {p.get('failed', 0)} failed, {p.get('errors', 0)} errors, "
                  f"{p.get('skipped', 0)} skipped" + (": " + ", ".join(p["failures"][:10]) if p.get("failures") else "")
                  + (f" and {len(p['failures']) - 10} more (pytest.json)" if len(p.get("failures", [])) > 10 else "")
                  + ".", ""]
    par = doc.get("parity")
    if par is not None and "systems" in par and "tolerance" in par:  # a run before [Note: the parity bar]
        lines += ["Parity with plain torch (fp32 MLP, TF32 off, same weights and batches): " + "; ".join(
            f"`{k}` max relative loss error {v['max_rel_error_vs_plain']:.2e}"
            + (", bitwise equal" if v["bitwise_equal_to_plain"] else "") for k, v in par["systems"].items())
            + f" (tolerance {par['tolerance']:g}).", ""]
    elif par is not None and "systems" in par:
        adam = par["cpu_vs_device_adamw"]
        lines += ["Parity (fp32 MLP, TF32 off, same weights and batches; bar: benchmarks/gpu/bench_gpu.py, "
                  "[Note: the parity bar]): " + "; ".join(
                      f"`{k}` {'bitwise equal to' if v['bitwise_equal_to_reference'] else 'NOT bitwise equal to'} "
                      f"`{v['reference']}` (max relative loss error vs `plain` {v['max_rel_error_vs_plain']:.2e})"
                      for k, v in par["systems"].items())
                  + f"; CPU vs {adam['device']} fused AdamW, one step from one state: largest difference "
                  f"{adam['max_difference_over_bound']:.3f} of its bound ({'within' if adam['within_bound'] else 'PAST it'}).",
                  ""]
    elif par is not None:
        lines += _did_not_run("Parity", par)
    return lines


def _section(name: str, render, *args) -> list[str]:  # noqa: ANN001 - a section renderer
    """One section; a document it cannot render (a stage's own shape changed, a partial result) is
    said in one line instead of losing the whole page."""
    try:
        return render(*args)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        return [f"**{name}**: could not render its result ({type(exc).__name__}: {exc}); see gpu-results.json", ""]


SECTIONS = (
    ("build", lambda doc: _build(doc)),
    ("offload", lambda doc: _shapes("Offload tiers: ours (host memory) vs FSDP2 CPUOffloadPolicy vs DeepSpeed ZeRO-3 "
                                    "CPU offload, and all on the GPU", doc)),
    ("nvme", lambda doc: _shapes("NVMe tier: ours vs DeepSpeed ZeRO-Infinity", doc)),
    ("planner", lambda doc: _planner(doc)),
    ("staged", lambda doc: _staged(doc)),
    ("device", lambda doc: _timing("The fp32 MLP all on the GPU: ours vs plain torch", doc)),
)
"""Stage -> its section, in the page's order (after the call, the must-shows and the checks)."""


def markdown(doc: dict) -> str:
    e = doc.get("env", {})
    dry = any(k.get("dry_run") for k in doc.get("calls") or [doc.get("kit", {})])
    gpu = e.get("gpu") or ("none, a dry run on the CPU" if dry else e.get("nvidia_smi", "unknown GPU"))
    lines = ["## On a GPU: `bash benchmarks/gpu/run.sh`", "",
             f"GPU: **{gpu}** (nvidia-smi: {e.get('nvidia_smi')}); torch {e.get('torch')}, CUDA {e.get('cuda')}, "
             f"Python {e.get('python')}, {e.get('cpu_count')} CPUs, kernel {e.get('kernel')}. Every ratio is measured "
             "side by side in one process on the same model, batch, precision and GPU (docs/gpu.md).", ""]
    if "kit" in doc or doc.get("calls"):
        lines += _section("The call", _calls, doc)
    lines += _section("Must-shows", _must_show_table, doc)
    lines += _section("Checks", _checks, doc)
    for stage, render in SECTIONS:
        if stage in doc:
            lines += _section(stage, render, doc[stage])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"]:
        print(json.dumps(env(), indent=2))
        return 0
    if argv[:1] == ["junit"] and len(argv) in (3, 4):
        Path(argv[2]).write_text(json.dumps(junit(Path(argv[1]), no_gpu=argv[3:] == ["--no-gpu"]), indent=2))
        return 0
    if argv[:1] == ["publish"] and len(argv) == 4:
        publish(Path(argv[1]), argv[2], json.loads(Path(argv[3]).read_text()))
        return 0
    if argv[:1] == ["md"] and len(argv) > 1:
        files = [a for a in argv[1:] if a != "--write-results"]
        text = markdown(merge([json.loads(Path(f).read_text()) for f in files]))
        print(text)
        if "--write-results" in argv:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            import results_md

            results_md.write_section("gpu", text)
        return 0
    print("usage: report.py env | junit XML OUT.json [--no-gpu] | publish OUTDIR STAGE FILE | md RESULTS.json... [--write-results]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
