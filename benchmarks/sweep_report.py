"""Writes the sweep's results: docs/calibration.md (table), docs/sweep-scatter.png and the
`sweep` section of benchmarks/RESULTS.md. Called by `benchmarks/sweep.py --write-results`."""

from __future__ import annotations

from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs

from planner.specs.hardware import NodeSpec
from planner.specs.plan import TIERS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
COMMAND = "python benchmarks/sweep.py --write-results"


def _pct(predicted: float, measured: float) -> str:
    if measured == 0:
        return "exact" if predicted == 0 else "n/a (0 measured)"
    return f"{(predicted - measured) / measured:+.1%}"


def table(report: dict) -> str:
    lines = ["| config | set | measured s | rounds' medians s | predicted s (probe) | error | calibrated s | error | "
             + " | ".join(f"peak {t} MB pred / meas (error)" for t in TIERS) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(TIERS)]
    for r in report["rows"]:
        peaks = " | ".join(
            f"{r[f'peak_{t}_predicted'] / 1e6:.1f} / {r[f'peak_{t}_measured'] / 1e6:.1f} "
            f"({_pct(r[f'peak_{t}_predicted'], r[f'peak_{t}_measured'])})" for t in TIERS)
        lines.append(f"| {r['config']} | {'calibration' if r['calibration'] else 'held out'} | {r['measured_s']:.3f} | "
                     f"{', '.join(f'{t:.3f}' for t in r.get('round_medians_s', []))} | {r['predicted_s']:.3f} | {_pct(r['predicted_s'], r['measured_s'])} | {r['calibrated_s']:.3f} | "
                     f"{_pct(r['calibrated_s'], r['measured_s'])} | {peaks} |")
    return "\n".join(lines)


def summary(report: dict) -> str:
    s = report["summary"]
    out = []
    # The probe calibrates on its own reference runs, none of them a sweep configuration, so every
    # configuration is one the probe's spec never saw (planner/calibration/probe_reference.py).
    for key, label in (("predicted_all", "probe spec, every configuration (none run by the probe)"),
                       ("predicted_held_out", "probe spec, held out"), ("calibrated_held_out", "calibrated, held out"),
                       ("calibrated_calibration", "calibrated, calibration set")):
        if key in s:
            out.append(f"- {label}: median |error| {s[key]['median_abs_error']:.1%}, worst "
                       f"{s[key]['worst_abs_error']:.1%} ({s[key]['count']} configurations)")
    peaks = [abs(r[f"peak_{t}_predicted"] - r[f"peak_{t}_measured"]) / r[f"peak_{t}_measured"]
             for r in report["rows"] for t in TIERS if r[f"peak_{t}_measured"] > 0]
    within = sum(e <= 0.05 for e in peaks)
    out.append(f"- peak bytes per tier (runtime buffers, nonzero tiers): {within} of {len(peaks)} within 5%, "
               f"worst {max(peaks):.1%}" if peaks else "- no nonzero peaks measured")
    return "\n".join(out)


def scatter(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    rows = report["rows"]
    for key, marker, label in (("predicted_s", "o", "probe spec"), ("calibrated_s", "^", "calibrated")):
        for cal, fill in ((True, "none"), (False, None)):
            pts = [(r["measured_s"], r[key]) for r in rows if r["calibration"] is cal]
            if pts:
                ax.scatter(*zip(*pts, strict=True), marker=marker, facecolors=fill,
                           label=f"{label}, {'calibration set' if cal else 'held out'}",
                           edgecolors="C0" if key == "predicted_s" else "C1",
                           color="C0" if key == "predicted_s" else "C1")
    hi = max(max(r["measured_s"], r["predicted_s"], r["calibrated_s"]) for r in rows) * 1.1
    lo = min(min(r["measured_s"], r["predicted_s"], r["calibrated_s"]) for r in rows) / 1.1
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.9", label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured iteration time (s, median)")
    ax.set_ylabel("predicted iteration time (s)")
    ax.set_title("Simulator vs runtime on this machine")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_results(report: dict, node: NodeSpec) -> None:
    m = report["machine"]
    facts = results_md.MachineFacts.from_dict(m["facts"])
    machine = (f"{m['rounds']} rounds of {m['steps_per_config']} steps ({m['warmup_steps']} warm-up) per "
               f"configuration, {m['priority'] or 'priority as started'}. {facts.describe()}")
    cal = report["calibration"]
    residual = f"{cal['residual']:.1%}" if cal else "n/a"
    factors = ", ".join(f"{k} {v:.4g}" for k, v in cal["factors"].items()) if cal else "none"
    probe = (f"Probed spec: {node.gpu_flops_per_s / 1e12:.3f} TFLOPS, CPU AdamW {node.cpu_adam_params_per_s / 1e9:.2f} "
             f"G params/s, NVMe {node.nvme_read_bytes_per_s / 1e9:.2f} / {node.nvme_write_bytes_per_s / 1e9:.2f} GB/s, "
             f"{node.operator_overhead_s * 1e3:.2f} ms per operator")
    scatter(report, DOCS / "sweep-scatter.png")
    body = f"""## Simulator vs runtime (sweep)

`{COMMAND}`: {machine} {probe}. Calibration factors (fit on the calibration set, residual
{residual}): {factors}.

{summary(report)}

{table(report)}
"""
    results_md.write_section("sweep", body)
    doc = f"""`python benchmarks/sweep.py --write-results` probes the machine it runs on (`planner probe`, which on a CPU-only machine calibrates itself on
four reference runs of the runtime that are not sweep configurations: planner/calibration/probe_reference.py
[Note: probe reference runs]), plans every configuration of `benchmarks/sweep.py` with the probed
spec, trains each with the real runtime (`planner run`), fits the spec's efficiency parameters
further on four of them (`planner calibrate`, planner/calibration/calibrate.py [Note: the calibration model])
and predicts the rest again with that calibrated spec. Peak bytes are the runtime's own ledger per tier against
the memory bill over the terms that ledger tracks (`runtime_buffer_peak_bytes`: the bill without
autograd's activations, logits and allocator slack).

Run: {machine} {probe}.

{summary(report)}

![predicted vs measured](sweep-scatter.png)

{table(report)}

## Doing it yourself

```
planner probe --out hw.json
planner fit --hardware hw.json --layers 4 --hidden 512 --heads 8 --seq 256 --vocab 256 \\
    --batch-per-gpu 4 --placement params=cpu,gradients=cpu,optimizer_states=cpu --out plan.json
planner run plan.json --steps 5 --profile-out run.json
planner calibrate run.json other-run.json --hardware hw.json --out hw-calibrated.json
planner compare plan.json run.json --hardware hw-calibrated.json
```
"""
    # Only the generated part: what follows its end marker in docs/calibration.md is kept by hand.
    results_md.write_section("calibration", doc, DOCS / "calibration.md")
