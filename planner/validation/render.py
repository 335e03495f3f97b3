"""Views of a ValidationReport: markdown (`--out report.md`, docs/validation.md), rich tables and the
predicted-vs-measured scatter. No number is computed here beyond formatting."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from planner.validation.report import RowResult, ValidationReport

SUMMARY_COLUMNS = ("rows", "predicted", "misses", "refused by memory bill", "median |error|", "p90 |error|", "median error")
_KEYS = ("rows", "predicted", "misses", "refused_by_memory_bill", "median_abs_error", "p90_abs_error", "median_error")


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * 100:+.1f} %" if signed else f"{value * 100:.1f} %"


def summary_cells(group: dict[str, Any]) -> list[str]:
    return [str(group[k]) for k in _KEYS[:4]] + [_pct(group["median_abs_error"]), _pct(group["p90_abs_error"]),
                                                 _pct(group["median_error"], signed=True)]


def _table(title: str, groups: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"| {title} | " + " | ".join(SUMMARY_COLUMNS) + " |", "|---" * (len(SUMMARY_COLUMNS) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(summary_cells(group)) + " |" for name, group in groups.items()]
    return lines


def reason_kinds(results: tuple[RowResult, ...]) -> Counter[str]:
    """How many rows name each missing feature (a row with several counts under each)."""
    kinds: Counter[str] = Counter()
    for r in results:
        if r.error is None and r.reason:
            for reason in r.reason.split("; "):
                kinds[reason.split(":")[0].split(" (")[0]] += 1
    return kinds


def _row_line(r: RowResult) -> str:
    x = r.row
    predicted = "-" if r.predicted is None else f"{r.predicted:,.4g}"
    return (f"| {x.row_id} | {x.source_id} | {x.gpu_family} | {x.model_name} | {x.num_gpus} | {r.metric} | "
            f"{r.measured:,.4g} | {predicted} | {_pct(r.error, signed=True)} | {r.bottleneck or '-'} | "
            f"{(r.reason or '').replace('|', '/')} |")


ROW_HEADER = ["| row | source | GPU | model | GPUs | metric | measured | predicted | error | bottleneck | reason |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]


def markdown(report: ValidationReport, *, all_rows: bool = True, scatter: str | None = None) -> str:
    s = report.summary()
    lines = [f"Corpus: {s['corpus']}; prediction: {s['method']}. `error = predicted / measured - 1` in the row's "
             "own metric; a row the planner cannot express has no error and counts as a miss. Offload rows "
             "(CPU/NVMe) are checks, summarised apart.", ""]
    if s["filters"]:
        lines += ["Filters: " + ", ".join(f"{k} {v}" for k, v in s["filters"].items()), ""]
    if scatter:
        lines += [f"![predicted vs measured tokens/s per GPU]({scatter})", ""]
    lines += ["### Per GPU type", ""] + _table("GPU", {"all": s["all"], **s["by_gpu_type"]})
    lines += fitted_lines(s["fitted"])
    lines += ["", "### Per source", ""] + _table("source", s["by_source"])
    lines += ["", "### Offload rows (checks, not calibration)", ""] + _table("offload", {"all": s["offload_checks"]})
    lines += ["", "### Why rows have no prediction", "", "| reason | rows |", "|---|---|"]
    lines += [f"| {kind} | {count} |" for kind, count in reason_kinds(report.results).most_common()]
    lines += searched_lines(report.results)
    worst = sorted((r for r in report.results if r.error is not None), key=lambda r: -abs(r.error))[:10]
    lines += ["", "### Worst 10 predicted rows", ""] + ROW_HEADER + [_row_line(r) for r in worst]
    if all_rows:
        lines += ["", "### Every row", ""] + ROW_HEADER + [_row_line(r) for r in report.results]
    return "\n".join(lines) + "\n"


def searched_lines(results: tuple[RowResult, ...]) -> list[str]:
    """The settings a row left unstated and the planner searched, with what it chose
    (planner/validation/unstated.py [Note: unstated settings are searched])."""
    rows = [(r, [a.removeprefix("searched ") for a in r.assumptions if a.startswith("searched ")]) for r in results]
    rows = [(r, searched) for r, searched in rows if searched]
    if not rows:
        return []
    lines = ["", "### Settings searched where a row leaves them unstated", "",
             "The planner's fastest configuration that fits, as `planner fit` searches unpinned knobs "
             "(planner/validation/unstated.py).", "", "| row | source | error | searched: chosen |", "|---|---|---|---|"]
    lines += [f"| {r.row.row_id} | {r.row.source_id} | {_pct(r.error, signed=True)} | "
              f"{'; '.join(searched).replace('|', '/')} |" for r, searched in rows]
    return lines


FITTED_COLUMNS = ("fitted rows", "before fit: median |error|", "in-sample median |error|", "in-sample p90",
                  "leave-one-source-out median |error|", "LOSO p90", "LOSO median error")


def fitted_cells(group: dict[str, Any]) -> list[str]:
    cells = [str(group["fitted_rows"]), _pct(group["prior_in_sample"]["median_abs_error"]),
             _pct(group["in_sample"]["median_abs_error"]), _pct(group["in_sample"]["p90_abs_error"])]
    loso = group["leave_one_source_out"]
    if loso is None and group.get("leave_one_source_out_not_defined"):
        return cells + ["not defined (one source)", "-", "-"]
    loso = loso or {"median_abs_error": None, "p90_abs_error": None, "median_error": None}
    return cells + [_pct(loso["median_abs_error"]), _pct(loso["p90_abs_error"]), _pct(loso["median_error"], signed=True)]


def fitted_lines(fitted: dict[str, Any]) -> list[str]:
    """The fitted presets' in-sample error (the rows they were fitted on) beside the leave-one-source-out
    error (each source predicted by a fit on the others: the number to trust), per generation."""
    if not fitted:
        return []
    lines = ["", "### Fitted presets: in-sample vs leave-one-source-out", "",
             "In-sample errors are on the rows the presets were fitted on; leave-one-source-out predicts each "
             "source from a fit on the other sources' rows (planner/validation/fit.py [Note: leave one source out]). "
             "A generation with a single source (V100) has no leave-one-source-out error: holding its source "
             "out leaves nothing to fit on. It is checked by its in-sample error and by the ZeRO-Infinity "
             "paper's configurations (the top of docs/validation.md).", "",
             "| GPU | " + " | ".join(FITTED_COLUMNS) + " | fitted parameters |", "|---" * (len(FITTED_COLUMNS) + 2) + "|"]
    for generation, group in fitted.items():
        params = ", ".join(f"{k} {v:.3g}" for k, v in group["params"].items())
        lines.append(f"| {generation} | " + " | ".join(fitted_cells(group)) + f" | {params} |")
    lines += ["", "| GPU / held-out source | fitted on rows | held-out rows | median |error| | p90 |error| | median error |",
              "|---|---|---|---|---|---|"]
    for generation, group in fitted.items():
        for source, held in group["leave_one_source_out_by_source"].items():
            lines.append(f"| {generation} / {source} | {held['fitted_on_rows']} | {held['rows']} | "
                         f"{_pct(held['median_abs_error'])} | {_pct(held['p90_abs_error'])} | "
                         f"{_pct(held['median_error'], signed=True)} |")
    return lines


def rich_tables(report: ValidationReport) -> list[Any]:
    """Summary per GPU type, then per (GPU type, source), for the terminal."""
    from rich.table import Table

    s = report.summary()
    tables = []
    for title, groups in (("Per GPU type", {"all": s["all"], **s["by_gpu_type"]}),
                          ("Per GPU type and source", _by_gpu_and_source(report)),
                          ("Offload rows (checks)", {"offload": s["offload_checks"]})):
        table = Table(title=title, title_justify="left")
        table.add_column("group")
        for column in SUMMARY_COLUMNS:
            table.add_column(column, justify="right")
        for name, group in groups.items():
            table.add_row(name, *summary_cells(group))
        tables.append(table)
    if s["fitted"]:
        table = Table(title="Fitted presets: in-sample vs leave-one-source-out", title_justify="left")
        table.add_column("GPU")
        for column in FITTED_COLUMNS:
            table.add_column(column, justify="right")
        for generation, group in s["fitted"].items():
            table.add_row(generation, *fitted_cells(group))
        tables.append(table)
    return tables


def _by_gpu_and_source(report: ValidationReport) -> dict[str, dict[str, Any]]:
    from planner.validation.report import group_summary

    groups: dict[str, list[RowResult]] = {}
    for r in report.results:
        if not r.offload:
            groups.setdefault(f"{r.row.gpu_family} / {r.row.source_id}", []).append(r)
    return {name: group_summary(members) for name, members in sorted(groups.items())}


GPU_COLOURS = {"V100": "tab:purple", "A100": "tab:blue", "H100": "tab:orange", "H200": "tab:red", "RTX 4090": "tab:green"}


def scatter(report: ValidationReport, path: str | Path) -> Path:
    """Predicted vs measured tokens/s per GPU, log-log, one colour per GPU type, offload rows hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6), dpi=110)
    points = [r for r in report.results if r.tokens_per_s_per_gpu is not None]
    for family, colour in GPU_COLOURS.items():
        for offload in (False, True):
            xs = [r.tokens_per_s_per_gpu[1] for r in points if r.row.gpu_family == family and r.offload == offload]
            ys = [r.tokens_per_s_per_gpu[0] for r in points if r.row.gpu_family == family and r.offload == offload]
            if xs:
                ax.scatter(xs, ys, s=18, label=f"{family}{' (offload check)' if offload else ''}",
                           facecolors="none" if offload else colour, edgecolors=colour, linewidths=0.8)
    values = [v for r in points for v in r.tokens_per_s_per_gpu]
    low, high = (min(values) / 1.5, max(values) * 1.5) if values else (1, 10)
    ax.plot([low, high], [low, high], color="black", linewidth=0.8, label="predicted = measured")
    for factor in (1.25, 0.8):
        ax.plot([low, high], [low * factor, high * factor], color="grey", linewidth=0.6, linestyle="--")
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high),
           xlabel="measured tokens/s per GPU", ylabel="predicted tokens/s per GPU",
           title=f"Planner vs published runs ({len(points)} of {len(report.results)} rows predicted; dashed: ±25 %)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
