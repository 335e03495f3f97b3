"""Dashboard response time; target: every interaction for 1T on 16 GPUs answers within 1 s.

Each interaction is one widget change followed by a full script rerun in Streamlit's AppTest (the
same code path as a browser session, minus the websocket and drawing), timed from `set_value` to
the end of the rerun. The sequence starts from the default view (1T, dgx-h100, 16 GPUs) after one
warm-up run; before each repetition the caches (Streamlit's, and the simulation samples that
planner.sim.samples keeps) are cleared and the default view is run once, so every interaction pays
for what it newly computes exactly as a user's first visit would.

    python benchmarks/app_speed.py [--repeats 5] [--json] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs
import streamlit as st
from streamlit.testing.v1 import AppTest

from planner.sim import samples

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "app" / "dashboard.py")
TARGET_S = 1.0

# (what the user does, widget kind or "tab", widget key or tab label, value). Tabs are lazy (only the
# open one runs), so the sequence opens each panel and changes inputs with the heavier ones open.
INTERACTIONS = [
    ("GPUs 16 -> 32", "number_input", "gpus", 32),
    ("GPUs 32 -> 16 (seen before)", "number_input", "gpus", 16),
    ("NVMe write 28 -> 56 GB/s", "number_input", "hw:dgx-h100:nvme_write_gb_per_s", 56.0),
    ("PCIe host->GPU 50 -> 25 GB/s", "number_input", "hw:dgx-h100:host_to_gpu_gb_per_s", 25.0),
    ("CPU memory 2048 -> 4096 GiB", "number_input", "hw:dgx-h100:cpu_memory_gib", 4096.0),
    ("pin batch/GPU 4", "number_input", "batch", 4.0),
    ("unpin batch", "number_input", "batch", None),
    ("strategy zero-inf-nvme", "selectbox", "strategy", "zero-inf-nvme"),
    ("strategy auto", "selectbox", "strategy", "auto"),
    ("pin params=cpu", "selectbox", "pin:params", "cpu"),
    ("unpin params", "selectbox", "pin:params", "auto"),
    ("precision fp16", "selectbox", "precision", "fp16"),
    ("model-parallel auto", "selectbox", "model_parallel", "auto"),
    ("model-parallel 1", "selectbox", "model_parallel", "1"),
    ("sequence 2048", "number_input", "seq", 2048),
    ("sequence: model's own", "number_input", "seq", None),
    ("model 1T -> 2T", "text_input", "model", "2T"),
    ("model 2T -> 1T", "text_input", "model", "1T"),
    ("bad value: NVMe read -5", "number_input", "hw:dgx-h100:nvme_read_gb_per_s", -5.0),
    ("NVMe read back to 50", "number_input", "hw:dgx-h100:nvme_read_gb_per_s", 50.0),
    ("open Strategies", "tab", "Strategies", None),
    ("GPUs 16 -> 24 (Strategies open)", "number_input", "gpus", 24),
    ("open Timeline (simulate)", "tab", "Timeline", None),
    ("GPUs 24 -> 16 (Timeline open)", "number_input", "gpus", 16),
    ("NVMe write 56 -> 40 GB/s (Timeline open)", "number_input", "hw:dgx-h100:nvme_write_gb_per_s", 40.0),
    ("GPUs 16 -> 32 (Timeline open)", "number_input", "gpus", 32),
    ("GPUs 32 -> 16 (Timeline open)", "number_input", "gpus", 16),
    ("open Bandwidth (eq. 6)", "tab", "Bandwidth (eq. 6)", None),
    ("open Largest model", "tab", "Largest model", None),
    ("NVMe capacity 28610 -> 14000 GiB (Largest model open)", "number_input", "hw:dgx-h100:nvme_capacity_gib", 14000.0),
    ("GPUs 16 -> 64 (Largest model open)", "number_input", "gpus", 64),
    ("open Predicted vs measured", "tab", "Predicted vs measured", None),
    ("rank by simulation off (analytic ranking)", "toggle", "refine", False),
    ("GPUs 64 -> 16 (analytic ranking)", "number_input", "gpus", 16),
    ("rank by simulation back on (the default)", "toggle", "refine", True),
    ("open Memory per tier", "tab", "Memory per tier", None),
]


def _act(at: AppTest, kind: str, key: str, value) -> None:
    if kind == "tab":
        at.session_state["panel"] = key
        at.run()
    elif kind == "toggle":
        at.toggle(key=key).set_value(value).run()
    else:
        getattr(at.sidebar, kind)(key=key).set_value(value).run()


def one_repetition() -> tuple[float, dict[str, float]]:
    st.cache_data.clear()
    st.cache_resource.clear()  # the simulations
    samples.forget_samples()  # the samples refine keeps for the Timeline panel ([Note: shared samples])
    at = AppTest.from_file(SCRIPT, default_timeout=300)
    start = time.perf_counter()
    at.run()
    cold = time.perf_counter() - start
    assert not at.exception, [e.value for e in at.exception]
    times = {}
    for label, kind, key, value in INTERACTIONS:
        start = time.perf_counter()
        _act(at, kind, key, value)
        times[label] = time.perf_counter() - start
        assert not at.exception, (label, [e.value for e in at.exception])
        assert label.startswith("bad value") or not at.error, (label, [e.value for e in at.error])
    return cold, times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write-results", action="store_true", help="append a section to benchmarks/RESULTS.md")
    args = parser.parse_args()
    machine = results_md.measure_machine(versions=("streamlit",))
    os.environ["TIERWISE_HISTORY"] = str(Path(tempfile.mkdtemp()) / "none.sqlite")
    one_repetition()  # warm-up: imports, presets, altair
    colds, runs = [], []
    for _ in range(args.repeats):
        cold, times = one_repetition()
        colds.append(cold)
        runs.append(times)
    summary = {
        label: {"median_s": statistics.median(r[label] for r in runs), "worst_s": max(r[label] for r in runs)}
        for label, *_ in INTERACTIONS
    }
    doc = {
        "machine": machine.finish().to_dict(),
        "repeats": args.repeats,
        "default_view_cold_median_s": statistics.median(colds),
        "interactions": summary,
        "worst_interaction_s": max(v["worst_s"] for v in summary.values()),
        "target_s": TARGET_S,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for label, v in summary.items():
            print(f"{label:55s} median {v['median_s']:.3f} s  worst {v['worst_s']:.3f} s")
        print(f"default view, cold caches: median {doc['default_view_cold_median_s']:.3f} s")
    if args.write_results:
        write_results(doc, machine)


HEADING = "## Dashboard response time (`benchmarks/app_speed.py`)"


def write_results(doc: dict, machine: results_md.MachineFacts) -> None:
    """Replace this benchmark's section of benchmarks/RESULTS.md (or append it); others stay as they are."""
    lines = [
        HEADING,
        "",
        f"Target: every interaction for 1T on 16 GPUs answers within {TARGET_S:g} s. One widget change plus",
        "the full rerun in Streamlit's AppTest, each interaction computing what it newly needs (caches cleared",
        f"before each of {doc['repeats']} repetitions). Tabs are lazy: only the open panel runs.",
        machine.describe(),
        "",
        "| interaction | median | worst |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {v['median_s']:.2f} s | {v['worst_s']:.2f} s |" for label, v in doc["interactions"].items()]
    lines += [
        "",
        f"Default view with cold caches (first visit): median {doc['default_view_cold_median_s']:.2f} s. "
        f"Worst interaction: {doc['worst_interaction_s']:.2f} s.",
        "",
        "Over the target (worst case): "
        + (", ".join(f"{label} ({v['median_s']:.2f} s median)" for label, v in doc["interactions"].items()
                     if v["worst_s"] > TARGET_S) or "none") + ".",
        "The page ranks the top placements by simulation by default (`planner.search.refine.refine`, what",
        "`planner fit` reports), cached per question; the Timeline panel's Gantt chart is the simulator's",
        "binned data (`planner.output.timeline.busy_bins`, `zoom_spans`) drawn by the browser (Vega-Lite).",
        f"`python benchmarks/app_speed.py --repeats {doc['repeats']} --write-results` reproduces this section.",
        "",
    ]
    results_md.write_section("app_speed", "\n".join(lines))

if __name__ == "__main__":
    main()
