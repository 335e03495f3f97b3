"""The simulated iteration as a picture: a Gantt chart of every resource with memory curves beneath.

Readable for a 128-layer model: the full-iteration chart merges busy intervals closer than a
pixel (a 1T iteration has tens of thousands), a second chart zooms on one recompute segment of the
backward pass where single operators are visible, and the memory curves share the full chart's time
axis. matplotlib is imported here only, so `planner` starts fast.
"""

from __future__ import annotations

from pathlib import Path

from planner.output.report import batch_words, bottleneck_label
from planner.sim.report import SimResult
from planner.specs.errors import PlannerError
from planner.specs.phases import Phase
from planner.specs.tiers import GPU, HOST, TIERS
from planner.specs.units import GIB

PHASE_COLORS = {Phase.FORWARD: "#4C72B0", Phase.RECOMPUTE: "#DD8452", Phase.BACKWARD: "#55A868", Phase.OPTIMIZER: "#C44E52"}
def row_labels() -> dict[str, str]:
    """The chart's rows, in order, with their labels; a staged tier's links are named after the tier."""
    stores = {name: f"{tier.label}{what} (node)" for tier in TIERS if tier.staged
              for name, what in ((str(tier), " read+write"), (tier.read_link, " read"), (tier.write_link, " write"))}
    return {"gpu_compute": "GPU compute", "gpu_gpu": "GPU-GPU (all-gather / reduce-scatter)", "h2d": "host->GPU (PCIe)",
            "d2h": "GPU->host (PCIe)", "host_memory": "host memory fabric (node)", **stores,
            "cpu_optimizer": "CPU optimizer (node)", "inter_node": "network (node)"}


ROW_LABELS = row_labels()
"""The built-in tiers' rows (`row_labels()` reads a registered tier's too)."""
ROW_ORDER = tuple(ROW_LABELS)
PIXELS = 1800
BINS = 500
"""The full-iteration chart shows busy fraction per bin: finer than this is not readable anyway."""


def draw(result: SimResult, path: str | Path, *, title: str | None = None, dpi: int = 110) -> Path:
    """Write the timeline PNG to `path` and return it."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tl, prediction = result.timelines, result.prediction
    total = tl.iteration_time_s
    rows, labels = gantt_rows(result), row_labels()
    fig, (full, zoom, gpu_ax, cpu_ax) = _figure(plt, len(rows))

    window, spans = zoom_spans(result)
    edges = np.linspace(0.0, total, BINS + 1)
    for y, name in enumerate(rows):
        # Full iteration: each bin's bar is as tall as the share of the bin the resource was busy.
        bottom = [y + 0.4] * (BINS + 1)
        for label, busy in _binned(tl.intervals[name], edges).items():
            busy = list(busy)
            top = [b - 0.8 * f for b, f in zip(bottom, busy + busy[-1:], strict=True)]
            full.fill_between(edges, bottom, top, step="post", color=PHASE_COLORS.get(label, "grey"), linewidth=0)
            bottom = top
        for label in PHASE_COLORS | {s["phase"]: None for s in spans}:
            mine = [(s["start_s"], s["end_s"] - s["start_s"]) for s in spans if s["resource"] == name and s["phase"] == label]
            if mine:
                zoom.broken_barh(mine, (y - 0.38, 0.76), facecolors=PHASE_COLORS.get(label, "grey"), linewidth=0)
    for ax, (lo, hi) in ((full, (0.0, total)), (zoom, window)):
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{labels[n]}  {prediction.details['resources'][n]['busy_fraction']:.0%}" for n in rows])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(lo, hi)
        ax.grid(axis="x", alpha=0.3)
        _phase_lines(ax, tl.phase_end_s)
    full.set_title(title or _title(result), fontsize=11, loc="left")
    zoom.set_title(f"zoom: {window[0]:.4g}-{window[1]:.4g} s ({zoom_caption(result)})", fontsize=10, loc="left")
    zoom.set_xlabel("seconds")
    # Above the zoom, right of its title: between the charts, over no bar.
    zoom.legend(handles=[Patch(color=c, label=p) for p, c in PHASE_COLORS.items()], loc="lower right",
                bbox_to_anchor=(1.0, 1.0), fontsize=8, ncols=4, frameon=False, borderaxespad=0.2)

    for ax, tracker in ((gpu_ax, tl.memory[GPU]), (cpu_ax, tl.memory[HOST])):
        times = [t for t, _ in tracker.points] + [total]
        used = [b / GIB for _, b in tracker.points]
        used.append(used[-1] if used else 0.0)
        ax.fill_between(times, used, step="post", color="#8172B3", alpha=0.55, linewidth=0, label=f"{tracker.name} in use")
        ax.axhline(tracker.capacity_bytes / GIB, color="#C44E52", linestyle="--", linewidth=1, label="capacity")
        ax.axhline(prediction.peak_bytes[tracker.name] / GIB, color="#555555", linestyle=":", linewidth=1,
                   label="memory bill (planner.cost.memory)")
        ax.set_ylabel(f"{tracker.name.upper()} GiB\n({tracker.scope})")
        top = max(tracker.capacity_bytes, tracker.peak_bytes, prediction.peak_bytes[tracker.name])
        ax.set_ylim(0, top / GIB * 1.08)
        low = tracker.peak_bytes < 0.5 * top  # the label goes above a low peak, so it stays inside the axes
        ax.annotate(f"simulated peak {tracker.peak_bytes / GIB:.1f} GiB", (tracker.peak_time_s, tracker.peak_bytes / GIB),
                    xytext=(5, 4 if low else -12), textcoords="offset points", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncols=3, frameon=False, borderaxespad=0.2)
        _phase_lines(ax, tl.phase_end_s)
    held = "; ".join(f"{tier.label} holds {tl.memory[tier].peak_bytes / GIB:,.0f} of "
                     f"{tl.memory[tier].capacity_bytes / GIB:,.0f} GiB per node" for tier in TIERS if tier.staged)
    cpu_ax.set_xlabel(f"seconds   ({held} for the whole iteration)")
    path = Path(path)
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise PlannerError(f"cannot write timeline to {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # matplotlib: an unknown image format (the file name's suffix)
        raise PlannerError(f"cannot write timeline to {path}: {str(exc).splitlines()[0]}; name it .png, .svg or .pdf") from None
    finally:
        plt.close(fig)
    return path


def _figure(plt, num_rows: int):  # noqa: ANN001, ANN202
    """The figure and its four axes, laid out in inches: the gaps hold tick labels, a title or legend
    row, whatever the number of rows (fractions of the height overlapped them on short charts).
    Fixed rectangles rather than constrained layout: that pass costs a whole extra draw (about 40%
    of `draw`), and the rows' labels have a known width."""
    width_in, left, right = 16.0, 0.19, 0.99
    gantt_in = 0.3 + 0.4 * num_rows
    # top margin (two-line title), full, gap (ticks + zoom title and legend), zoom, gap (ticks, x label,
    # legend), GPU memory, gap (ticks, legend), CPU memory, bottom margin (ticks, x label)
    heights = (0.75, gantt_in, 0.8, gantt_in, 0.85, 1.1, 0.6, 1.1, 0.6)
    height_in = sum(heights)
    fig = plt.figure(figsize=(width_in, height_in))
    axes, y = [], height_in
    for i, h in enumerate(heights[:-1]):
        y -= h
        if i % 2:  # odd entries are axes, even ones gaps
            share = {"sharex": axes[0]} if len(axes) >= 2 else {}
            axes.append(fig.add_axes((left, y / height_in, right - left, h / height_in), **share))
    return fig, axes


def _title(result: SimResult) -> str:
    from planner.output.verdict import critical_path  # the exposed critical path, as `planner fit` says it

    plan, p = result.plan, result.prediction
    bottleneck = critical_path(plan.replace(prediction=p), result.timelines).bottleneck if p.feasible else (
        bottleneck_label(p.bottleneck))
    return (f"{plan.model.name} on {plan.num_gpus} x {plan.node.name} GPUs, {plan.placement.label()}, "
            f"micro-batch {batch_words(plan)}, ci {plan.recompute_interval}, tiling {plan.tiling_factor}, "
            f"prefetch {plan.prefetch_depth}, mp {plan.model_parallel_degree}\nsimulated {p.iteration_time_s:.4g} s/iteration, "
            f"{p.tflops_per_gpu:.3g} TFLOPS/GPU, bottleneck {bottleneck}   (bar height and row label: busy fraction)")


def _zoom_window(result: SimResult) -> tuple[float, float]:
    """One repeating unit in the middle of the backward pass: a recompute segment, or a block
    without recompute (`zoom_caption` says which)."""
    tl = result.timelines
    start, end = tl.phase_end_s[Phase.FORWARD], tl.phase_end_s[Phase.BACKWARD]
    units = max(1, tl.num_segments if result.plan.recompute_interval else result.plan.model.num_layers)
    width = (end - start) / units
    lo = start + width * (units // 2)
    return lo, min(end, lo + width)


def zoom_caption(result: SimResult) -> str:
    """What the zoom shows, in the plan's terms: its recompute segment, or one block's backward."""
    ci = result.plan.recompute_interval
    if ci:
        blocks = "one block" if ci == 1 else f"{ci} blocks"
        return f"one recompute segment ({blocks}) of the backward pass: recompute, then backward"
    return "about one block of the backward pass (no recompute: backward only)"


def gantt_rows(result: SimResult) -> list[str]:
    """The resources that were ever busy, in the chart's order."""
    intervals = result.timelines.intervals
    return [name for name in row_labels() if intervals.get(name)]


def busy_bins(result: SimResult, bins: int = BINS) -> list[dict[str, object]]:
    """The full-iteration Gantt chart as data: per resource and bin of [0, iteration], the busy
    fraction of the bin and its split by phase label (what `draw` and the dashboard show)."""
    import numpy as np

    total = result.timelines.iteration_time_s
    edges = np.linspace(0.0, total, bins + 1)
    intervals = result.timelines.intervals
    shares = {name: _binned(intervals[name], edges) for name in gantt_rows(result)}
    labels = row_labels()
    phases = list(dict.fromkeys(p for row in shares.values() for p in row))
    out = []
    for name, row in shares.items():
        busy = sum(row.values())
        for i in np.flatnonzero(busy > 0):
            out.append({"resource": name, "label": labels[name], "start_s": float(edges[i]), "end_s": float(edges[i + 1]),
                        "busy": float(min(busy[i], 1.0)), "phase": max(row, key=lambda p: row[p][i]),
                        **{f"{p}_share": float(row[p][i]) if p in row else 0.0 for p in phases}})
    return out


def zoom_spans(result: SimResult, pixels: int = PIXELS) -> tuple[tuple[float, float], list[dict[str, object]]]:
    """One unit of the backward pass (`zoom_caption`), operator by operator: the window and its spans
    (same-phase spans closer than a pixel merged)."""
    lo, hi = _zoom_window(result)
    intervals, labels = result.timelines.intervals, row_labels()
    spans = [{"resource": name, "label": labels[name], "phase": phase, "start_s": a, "end_s": a + width}
             for name in gantt_rows(result)
             for phase, pairs in _merged(intervals[name], lo, hi, (hi - lo) / pixels).items()
             for a, width in pairs]
    return (lo, hi), spans


def _merged(intervals, lo: float, hi: float, pixel: float) -> dict[str, list[tuple[float, float]]]:
    """Clip to [lo, hi] and merge same-label spans whose gap is under a pixel: (start, width) lists."""
    out: dict[str, list[list[float]]] = {}
    for a, b, label in sorted(intervals):
        if b <= lo or a >= hi:
            continue
        a, b = max(a, lo), min(b, hi)
        spans = out.setdefault(label, [])
        if spans and a - spans[-1][1] < pixel:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return {label: [(a, max(b - a, pixel)) for a, b in spans] for label, spans in out.items()}


def _binned(intervals, edges):
    """Busy fraction of each bin between consecutive `edges`, per label (numpy arrays).

    A link's intervals never overlap (`Link` merges while busy), so the busy time before t is the
    durations of the intervals that started before t, less the part of the last one after t: one
    sorted search over all edges instead of a loop over bins per interval (a 1T iteration has tens
    of thousands of intervals).
    """
    import numpy as np

    width = edges[1] - edges[0]
    by_label: dict[str, list[tuple[float, float]]] = {}
    for a, b, label in intervals:
        by_label.setdefault(label, []).append((a, b))
    out = {}
    for label, pairs in by_label.items():
        ab = np.array(sorted(pairs))
        starts, ends = ab[:, 0], ab[:, 1]
        done = np.concatenate(([0.0], np.cumsum(ends - starts)))
        k = np.searchsorted(starts, edges, side="right")  # intervals started by each edge
        last = np.maximum(k - 1, 0)
        overhang = np.where(k > 0, np.maximum(ends[last] - edges, 0.0), 0.0)
        busy_before = done[k] - overhang
        out[label] = np.diff(busy_before) / width
    return out


def _phase_lines(ax, phase_end_s: dict[str, float]) -> None:
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        if phase in phase_end_s:
            ax.axvline(phase_end_s[phase], color="grey", linewidth=0.8, linestyle=":")
