"""`planner validate` before and after a change, per GPU: in-sample and leave-one-source-out.

    python benchmarks/validation_summary.py --before BEFORE.json [--write-results]

BEFORE.json is `planner validate --json` saved from the checkout before the change; the "after" side
is this checkout's `planner.validation.validate()` on its bundled corpus. The section reports, per GPU
type, the rows predicted and the median / p90 |error| of every predicted row (the presets are fitted on
these rows, so these are in-sample), the fitted rows' in-sample error and the leave-one-source-out
error (data/validation/fit.json, planner/validation/fit.py [Note: leave one source out]; V100 has a
single source, so none), and FlashAttention-2's Table 1 check: each row's error and, per kernel and
model, the 8K / 2K throughput ratio predicted against the paper's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import results_md  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.validation.report import FIT_JSON, percentile, validate  # noqa: E402

FIT_ROWS: dict[str, set[str]] = {gpu: set(record["rows"]) for gpu, record in json.loads(FIT_JSON.read_text()).items()}
"""Generation -> the rows its presets were fitted on (the last `python -m planner.validation.fit --write`)."""

GPUS = ("A100", "H100", "H200", "V100")
FLASH_ATTENTION_2_PAIRS = {("GPT3-1.3B", "eager"): ("p266", "p268"), ("GPT3-1.3B", "flash"): ("p267", "p269"),
                           ("GPT3-2.7B", "eager"): ("p270", "p272"), ("GPT3-2.7B", "flash"): ("p271", "p273")}
"""(model, kernel) -> (2K row, 8K row) of FlashAttention-2's Table 1 (Dao 2023, arXiv:2307.08691)."""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _pair(group: dict[str, Any] | None) -> str:
    if not group:
        return "-"
    return f"{_pct(group['median_abs_error'])} / {_pct(group['p90_abs_error'])}"


def _fitted(doc: dict[str, Any], gpu: str) -> tuple[str, str]:
    """(in-sample, leave-one-source-out) median / p90 of the fitted rows: the in-sample error is this
    JSON's own prediction of the rows data/validation/fit.json lists as fitted; the leave-one-source-out
    error is the one the JSON's fit record holds (it changes only when the presets are refitted)."""
    fitted = doc["summary"].get("fitted", {}).get(gpu)
    if fitted is None or gpu not in FIT_ROWS:
        return "-", "-"
    errors = sorted(abs(r["error"]) for r in doc["rows"] if r["row_id"] in FIT_ROWS[gpu] and r["error"] is not None)
    in_sample = {"median_abs_error": statistics.median(errors), "p90_abs_error": percentile(errors, 0.9)}
    loso = fitted.get("leave_one_source_out")
    loso_text = "not defined (one source)" if loso is None else _pair(loso) + f" ({loso['rows']} rows)"
    return _pair(in_sample) + f" ({len(errors)} rows)", loso_text


def gpu_lines(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    lines = ["| GPU | rows predicted | all predicted rows: median / p90 |error| | fitted rows, in sample | "
             "leave-one-source-out |", "|---|---|---|---|---|"]
    for gpu in GPUS:
        cells = []
        for doc in (before, after):
            group = doc["summary"]["by_gpu_type"].get(gpu)
            in_sample, loso = _fitted(doc, gpu)
            cells.append((f"{group['predicted']} of {group['rows']}" if group else "-", _pair(group), in_sample, loso))
        lines.append(f"| {gpu} | " + " | ".join(f"{b} -> {a}" for b, a in zip(*cells, strict=True)) + " |")
    return lines


def flash_attention_2_lines(after: dict[str, Any]) -> list[str]:
    rows = {r["row_id"]: r for r in after["rows"]}
    lines = ["| model | kernel | error at 2K | error at 8K | 8K / 2K measured | 8K / 2K predicted | ratio error |",
             "|---|---|---|---|---|---|---|"]
    for (model, kernel), (short, long) in FLASH_ATTENTION_2_PAIRS.items():
        a, b = rows[short], rows[long]
        measured = b["measured"] / a["measured"]
        predicted = b["predicted"] / a["predicted"] if a["predicted"] and b["predicted"] else None
        ratio_error = None if predicted is None else predicted / measured - 1
        lines.append(f"| {model} | {kernel} | {_pct(a['error'])} | {_pct(b['error'])} | {measured:.3f} | "
                     f"{'-' if predicted is None else f'{predicted:.3f}'} | {_pct(ratio_error)} |")
    return lines


def section(before: dict[str, Any], after: dict[str, Any], machine: results_md.MachineFacts) -> str:
    misses = "; ".join(f"{r['row_id']}: {r['reason']}" for r in after["rows"] if r["error"] is None)
    missed = sum(1 for r in after["rows"] if r["error"] is None)
    lines = ["## Published-runs validation before and after (`benchmarks/validation_summary.py`)", "",
             f"{machine.describe()} `planner validate` (simulated) on the bundled corpus, before -> after; "
             "median / p90 |error|. Fitted rows: those data/validation/fit.json lists, predicted by each side; "
             "leave-one-source-out (each source predicted from a fit on the others) as each side's fit record "
             "holds it.", ""]
    lines += gpu_lines(before, after)
    lines += ["", f"Rows without a prediction after: {missed} of {len(after['rows'])} ({misses}).", "",
              "FlashAttention-2's Table 1 (8 x A100 80GB, GPT-3 1.3B / 2.7B, with and without the fused kernel):", ""]
    lines += flash_attention_2_lines(after)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="`planner validate --json` of the checkout before")
    parser.add_argument("--write-results", action="store_true", help="write the section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    machine = results_md.measure_machine()
    before = json.loads(args.before.read_text())
    after = validate().to_json()
    body = section(before, after, machine.finish())
    print(body)
    if args.write_results:
        results_md.write_section("validation", body)


if __name__ == "__main__":
    main()
