"""Fit each GPU generation's compute numbers on the published-runs corpus, and say how well the fit
predicts a source it never saw.

Run: `python -m planner.validation.fit` (report) or `... --write` (write the presets and
data/validation/fit.json, which `planner validate` reports from).

Per GPU generation four physically meaningful numbers are fitted, nothing per row or per source,
and memory never ([Note: what is fitted], above `fit`); a fit frees only the numbers its rows pin
down ([Note: which parameters the rows free], above `significant_parameter`), and each source is
also predicted from a fit on the others ([Note: leave one source out], above
`leave_one_source_out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from planner.cost.fp8 import FP8_DENSE_TFLOPS
from planner.cost.kernels import HBM_ACHIEVABLE_FRACTION
from planner.specs.hardware import EfficiencyCurve, NodeSpec
from planner.validation.configure import RowPlan, row_plan
from planner.validation.corpus import CorpusRow, load_corpus
from planner.validation.flash_kernels import FlashKernel
from planner.validation.own_runs import own_run_rows
from planner.validation.report import FIT_JSON, percentile, predict_row

ROOT = Path(__file__).resolve().parent.parent.parent
HARDWARE_DIR = ROOT / "data" / "hardware"
GENERATIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "V100": (("V100",), ("dgx2-v100",)),
    "A100": (("A100",), ("dgx-a100-40g", "dgx-a100-80g")),
    "H100": (("H100", "H200"), ("dgx-h100", "h200-x1", "hgx-h200")),
}
"""Generation -> (corpus GPU families fitted together, presets that get the fitted numbers)."""
PARAMS: tuple[str, ...] = ("plateau", "half_gflop", "flash", "hbm", "fp8")
BOUNDS: dict[str, tuple[float, float]] = {"plateau": (0.1, 1.0), "half_gflop": (0.01, 1000.0), "flash": (0.05, 1.0),
                                          "hbm": (0.5, 0.92), "fp8": (0.1, 1.0)}
"""`hbm` at most 0.92: streaming copies reach 0.83-0.90 of the datasheet (planner/cost/kernels.py
HBM_ACHIEVABLE_FRACTION's sources), so a higher fraction would be a fudge, not a bandwidth."""
MATMUL_GFLOP_POINTS: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)
"""Where the fitted curve is sampled; it holds flat below 0.1 GFLOP (planner.specs.hardware.EfficiencyCurve),
where a kernel's launch, not its size, sets its time."""
LOSS_CAP = math.log(1.5)
STEPS: tuple[float, ...] = (0.3, 0.1, 0.03)
"""Log-space step sizes of the coordinate search, coarse to fine."""
MAX_EVALUATIONS = 100
"""Each search stops after this many loss evaluations (each simulates every row of the generation
once): a bounded, deterministic cost per fit."""
SIGNIFICANCE = 0.05
"""A parameter leaves the prior only where the rows move it significantly at this level, two-sided
(Student's t: [Note: which parameters the rows free])."""
JACOBIAN_STEP = 0.1
"""Log-space step of the finite differences that linearise the prediction around the current fit."""

SINGLE_SOURCE = "not defined: one source ({}); checked in-sample and on the ZeRO-Infinity paper's configurations"
"""Why a generation with fewer than two sources has no leave-one-source-out error."""

Params = dict[str, float]
PRIOR: dict[str, Params] = {
    "V100": {"plateau": 70 / 125, "half_gflop": 5.0, "flash": 0.0, "hbm": HBM_ACHIEVABLE_FRACTION, "fp8": 0.0},
    "A100": {"plateau": 200 / 312, "half_gflop": 10.0, "flash": 156 / 312, "hbm": HBM_ACHIEVABLE_FRACTION, "fp8": 0.0},
    "H100": {"plateau": 600 / 989, "half_gflop": 10.0, "flash": 346 / 989, "hbm": HBM_ACHIEVABLE_FRACTION,
             "fp8": 600 / 989},
}
"""The hand-set presets before fitting, the search's fixed starting point (so `--write` run twice
writes the same numbers): the paper's 70 of 125 TFLOPS and the same 64 % on A100 and H100 (600
of 989), FlashAttention-2's published 156 TFLOPS on A100 and its 35 % of the H100's peak (346 of
989, as the FlashAttention-3 paper measured it; planner/cost/kernels.py [Note: attention kernels]):
`flash` is FlashAttention-2's rate, and rows on the first FlashAttention run at their kernel's share
of it (planner/validation/flash_kernels.py), each curve's size at which it reached half its
plateau, the V100 microbenchmark's HBM fraction, and on H100 the same share of the fp8 datasheet
peak as of the bf16 one (no fp8 on V100 and A100)."""


def matmul_curve(half_gflop: float) -> EfficiencyCurve:
    return EfficiencyCurve(tuple((g * 1e9, max(1e-4, round(g / (g + half_gflop), 4))) for g in MATMUL_GFLOP_POINTS))


def apply(node: NodeSpec, params: Params, kernel: FlashKernel | None = None) -> NodeSpec:
    """`node` with the fitted numbers (rates only: memory is untouched); `flash` is FlashAttention-2's
    rate, and a row on another generation (`kernel`) runs at that kernel's share of it
    (planner/validation/flash_kernels.py [Note: FlashAttention generations])."""
    nominal = node.gpu_nominal_flops_per_s or node.gpu_flops_per_s
    changes: dict[str, Any] = {"gpu_flops_per_s": params["plateau"] * nominal,
                               "matmul_efficiency": matmul_curve(params["half_gflop"]),
                               "hbm_achievable_fraction": params["hbm"]}
    fp8_nominal = fp8_datasheet_flops_per_s(node)
    if params.get("fp8") and fp8_nominal:
        changes["fp8_matmul_flops_per_s"] = params["fp8"] * fp8_nominal
    if node.flash_attention_flops_per_s:
        share = kernel.rate_vs_flash_attention_2 if kernel is not None else 1.0
        changes["flash_attention_flops_per_s"] = params["flash"] * nominal * share
    return node.replace(**changes)


def fp8_datasheet_flops_per_s(node: NodeSpec) -> float:
    """The dense fp8 datasheet rate of `node`'s GPU (planner/cost/fp8.py FP8_DENSE_TFLOPS); 0 without one."""
    entry = FP8_DENSE_TFLOPS.get(node.name.split(" (")[0])
    return entry[0] * 1e12 if entry else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class FitRow:
    row: CorpusRow
    planned: RowPlan


def fit_rows(generation: str, rows: Sequence[CorpusRow] | None = None, *, own_runs: bool = True) -> list[FitRow]:
    """The generation's rows that calibrate: not offload (those are checks), with a plan whose
    settings the source states (none searched), on the preset's GPU (planner/validation/configure.py
    [Note: a part the preset does not describe]); then, with `own_runs`, the project's own recorded
    runs on the generation's GPUs (planner/validation/own_runs.py [Note: the project's own runs in
    the fit])."""
    families = GENERATIONS[generation][0]
    out = []
    for row in rows if rows is not None else load_corpus():
        if row.gpu_family in families and not row.is_offload:
            planned = row_plan(row)
            if planned.plan is not None and not planned.searched and not planned.unlike_preset:
                out.append(FitRow(row, planned))
    return out + [FitRow(row, planned) for row, planned in own_run_rows(families)] if own_runs else out


def errors(rows: Sequence[FitRow], params: Params, seen: Callable[[str], None] | None = None) -> dict[str, float]:
    """row_id -> predicted / measured - 1 under `params` (rows the simulator cannot time are left out)."""
    out = {}
    for r in rows:
        if seen is not None:
            seen(r.row.row_id)
        plan = r.planned.plan
        assert plan is not None
        node = apply(plan.node, params, r.planned.flash_kernel)
        planned = dataclasses.replace(r.planned, plan=plan.replace(node=node))
        result = predict_row(r.row, planned=planned)
        if result.error is not None and result.error > -1:
            out[r.row.row_id] = result.error
    return out


def loss(errs: dict[str, float]) -> float:
    if not errs:
        return math.inf
    return sum(min(abs(math.log1p(e)), LOSS_CAP) ** 2 for e in errs.values()) / len(errs)


# [Note: what is fitted] Per GPU generation (V100; A100 40 and 80 GB; H100 with the H200, whose SMs and
# clocks are the H100's: their rows and the project's own H200 run, planner/validation/own_runs.py,
# are fitted together), four physically meaningful numbers (five on H100) and nothing per row or per
# source:
# - `plateau`: the matmul rate a large GEMM sustains in training, as a fraction of the datasheet
#   peak (`gpu_peak_tflops = plateau x gpu_nominal_tflops`);
# - `half_gflop`: the matmul size reaching half the plateau; the preset's matmul efficiency curve is
#   `size / (size + half_gflop)` sampled per decade from 0.1 GFLOP (MATMUL_GFLOP_POINTS);
# - `flash`: FlashAttention-2's achieved rate as a fraction of the datasheet peak
#   (`flash_attention_tflops`; none on V100, which has no flash kernel); a row whose stack ran the
#   first FlashAttention times its attention at that kernel's published share of it
#   (planner/validation/flash_kernels.py [Note: FlashAttention generations]), so both kernels' rows
#   inform the one number;
# - `hbm`: the share of the datasheet HBM bandwidth memory-bound kernels stream at
#   (`hbm_achievable_fraction`, planner/cost/kernels.py);
# - `fp8`: the rate a large fp8 matmul sustains as a fraction of the fp8 datasheet peak
#   (`fp8_matmul_tflops`, H100/H200 only; planner/cost/fp8.py): the fp8 runs' own plateau, so rows
#   with fp8 linears do not move the bf16 one. Its prior is the bf16 prior's share (the old
#   assumption that a matmul reaches the same fraction of either peak); a generation without fp8
#   rows keeps it.
# A per-layer framework overhead is not fitted: tried as a fifth number (the simulator's
# `operator_overhead_ms`) on H100 it traded off against the matmul curve at the same in-sample
# error, so the rows do not show one apart from the curve. Memory is never fitted: only rates change, so every memory bill stays.
#
# The loss is the mean over the generation's predicted, non-offload rows of the squared log ratio
# predicted / measured, capped at LOSS_CAP (a row the model cannot describe, such as a missing
# network term, weighs no more than a 50 % miss). The search is a deterministic coordinate search in
# log space from the hand-set preset (PRIOR), within BOUNDS, with the simulated prediction
# (`planner.sim.fast.predict`, what `planner validate` and `planner fit` report): the analytic
# estimate has no matmul efficiency curve, so it cannot fit one.
def fit(rows: Sequence[FitRow], start: Params, seen: Callable[[str], None] | None = None) -> tuple[Params, int]:
    """[Note: which parameters the rows free]: forward selection from `start`, each freed parameter
    refitted by coordinate search in log space with those freed before it; (params, evaluations).
    Parameters never freed (`flash` without flash rows, any the rows cannot pin down) stay at `start`."""
    candidates = [p for p in PARAMS if p in start and start[p] > 0
                  and (p != "flash" or any(r.planned.plan.attention == "flash" for r in rows))
                  and (p != "fp8" or any(r.planned.plan.fp8_matmuls for r in rows))]
    best, free, evaluations = dict(start), [], 0
    if not rows:
        return best, 0
    while len(free) < len(candidates):
        chosen, used = significant_parameter(rows, best, free, [p for p in candidates if p not in free], seen)
        evaluations += used
        if chosen is None:
            break
        free.append(chosen)
        best, used = _search(rows, best, free, seen)
        evaluations += used
    return best, evaluations


def _search(rows: Sequence[FitRow], start: Params, free: Sequence[str],
            seen: Callable[[str], None] | None) -> tuple[Params, int]:
    """Coordinate search of `free` in log space from `start`, coarse to fine, at most MAX_EVALUATIONS."""
    best, evaluations = dict(start), 1
    best_loss = loss(errors(rows, best, seen))
    for step in STEPS:
        improved = True
        while improved:
            improved = False
            for name in free:
                for sign in (1, -1):
                    value = _stepped(name, best[name], sign * step)
                    if value == best[name]:
                        continue
                    trial = dict(best, **{name: value})
                    if evaluations >= MAX_EVALUATIONS:
                        return best, evaluations
                    trial_loss = loss(errors(rows, trial, seen))
                    evaluations += 1
                    if trial_loss < best_loss - 1e-12:
                        best, best_loss, improved = trial, trial_loss, True
                        break
    return best, evaluations


# [Note: which parameters the rows free] A fit frees only the parameters its rows pin down; the rest
# keep the prior's value. Freeing all four on any rows lets a few rows set numbers they barely
# constrain: rows of one source whose predictions scale with the attention kernel's rate and the HBM
# share almost exactly as with the plateau (torchtitan's few H100 rows) moved all four, and the
# held-out sources paid for it (docs/validation.md, Where this stands). The rule is
# forward selection by a t-test on the rows linearised around the current fit (finite differences,
# JACOBIAN_STEP): for each parameter not yet freed, the least-squares step of the log residuals on the
# columns of the freed parameters and its own, its standard error from the residual scatter with
# n - k degrees of freedom, and whether the step differs from zero at SIGNIFICANCE (Student's t, so
# that 5 rows cannot carry 4 numbers); of the significant ones the one the rows hold most information
# on (its column's part that the freed ones do not explain) is freed, the search refits every freed
# parameter, and the test repeats from there. A parameter collinear with those freed has no
# information and is never freed; one the rows show at the prior's value stays there, which is the
# same. Rows past LOSS_CAP carry no gradient in the loss and are left out of the test as well. The
# test treats rows as independent, though rows of one source share its software: their standard
# errors are if anything understated, so the rule errs towards freeing a number, never against.
def significant_parameter(rows: Sequence[FitRow], at: Params, free: Sequence[str], candidates: Sequence[str],
                          seen: Callable[[str], None] | None = None) -> tuple[str | None, int]:
    """Of the candidates the rows move significantly from `at` given those `free`, the one they hold
    most information on ([Note: which parameters the rows free]); (name or None, evaluations)."""
    import numpy as np

    base = errors(rows, at, seen)
    ids = [i for i, e in base.items() if abs(math.log1p(e)) < LOSS_CAP]  # capped rows carry no gradient
    columns, evaluations = {}, 1
    for name in [*free, *candidates]:
        moved = _stepped(name, at[name], JACOBIAN_STEP)
        moved = moved if moved != at[name] else _stepped(name, at[name], -JACOBIAN_STEP)
        trial = errors(rows, dict(at, **{name: moved}), seen)
        evaluations += 1
        h = math.log(moved / at[name])
        columns[name] = [(math.log1p(trial[i]) - math.log1p(base[i])) / h if i in trial else 0.0 for i in ids]
    residual = np.array([math.log1p(base[i]) for i in ids])
    best, best_information = None, 0.0
    for name in candidates:
        design = np.array([columns[p] for p in [*free, name]]).T
        dof = len(ids) - design.shape[1]
        if dof < 1:
            continue
        step, *_ = np.linalg.lstsq(design, -residual, rcond=None)
        scatter = float(np.sum((residual + design @ step) ** 2)) / dof
        others = design[:, :-1]  # the information is what the column holds that the freed ones do not
        own = design[:, -1] - (others @ np.linalg.lstsq(others, design[:, -1], rcond=None)[0] if free else 0)
        information = float(own @ own)
        if information <= 1e-12:
            continue
        significant = abs(step[-1]) > t_quantile(1 - SIGNIFICANCE / 2, dof) * math.sqrt(scatter / information)
        if significant and information > best_information:
            best, best_information = name, information
    return best, evaluations


@functools.cache
def t_quantile(probability: float, dof: int) -> float:
    """Student's t distribution's `probability` quantile with `dof` degrees of freedom (bisection on
    its density integrated by Simpson's rule; no statistics library in the planner's dependencies)."""
    norm = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def cdf(t: float, intervals: int = 2000) -> float:
        h = t / intervals
        density = [norm * (1 + (i * h) ** 2 / dof) ** (-(dof + 1) / 2) for i in range(intervals + 1)]
        return 0.5 + h / 3 * (density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2]))

    low, high = 0.0, 1000.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return (low + high) / 2


def _stepped(name: str, value: float, log_step: float) -> float:
    """`value` moved by `log_step` in log space within BOUNDS."""
    low, high = BOUNDS[name]
    return min(high, max(low, value * math.exp(log_step)))


def error_summary(errs: Sequence[float]) -> dict[str, Any]:
    absolute = sorted(abs(e) for e in errs)
    return {"rows": len(absolute), "median_abs_error": statistics.median(absolute) if absolute else None,
            "p90_abs_error": percentile(absolute, 0.9) if absolute else None,
            "median_error": statistics.median(errs) if errs else None}


Fits = dict[str | None, tuple[Params, int]]
"""Held-out source (None: none) -> (fitted params, evaluations), computed ahead (`--jobs`)."""


# [Note: leave one source out] For each source with rows of a generation, the same search from the
# same prior runs on the other sources' rows only, and predicts the held-out source's rows. The
# pooled held-out errors are the generation's prediction error; the in-sample error (all rows
# fitted) is reported beside it, labelled so. A generation with a single source (V100: Megatron-LM
# 2019 only) has no leave-one-source-out error: holding its source out leaves no row to fit on, and
# predicting it with the unfitted prior measures the prior, not the fit. Its summary is None with
# the reason (SINGLE_SOURCE); such a generation is checked by its in-sample error and, for V100, by
# the ZeRO-Infinity paper's configurations (docs/validation.md).
def leave_one_source_out(rows: Sequence[FitRow], start: Params, fits: Fits | None = None) -> dict[str, Any]:
    """[Note: leave one source out]: per source, the fit without it and its held-out errors."""
    sources = sorted({r.row.source_id for r in rows})
    if len(sources) < 2:
        return {"summary": None, "by_source": {}, "not_defined": SINGLE_SOURCE.format(", ".join(sources) or "none")}
    per_source, pooled = {}, {}
    for source in sources:
        train = [r for r in rows if r.row.source_id != source]
        held = [r for r in rows if r.row.source_id == source]
        params, _ = fits[source] if fits is not None else fit(train, start)
        held_errors = errors(held, params)
        pooled.update(held_errors)
        per_source[source] = {"fitted_on_rows": len(train), "params": _rounded(params),
                              **error_summary(list(held_errors.values())), "errors": _rounded(held_errors)}
    return {"summary": error_summary(list(pooled.values())), "by_source": per_source}


def fit_generation(generation: str, corpus: Sequence[CorpusRow] | None = None, *, loso: bool = True,
                   fits: Fits | None = None) -> dict[str, Any]:
    """The fitted parameters of one generation, their in-sample and leave-one-source-out errors."""
    rows = fit_rows(generation, corpus)
    start = PRIOR[generation]
    before = errors(rows, start)
    params, evaluations = fits[None] if fits is not None else fit(rows, start)
    after = errors(rows, params)
    out: dict[str, Any] = {
        "rows": sorted(after, key=_row_order), "prior": _rounded(start), "params": _rounded(params),
        "evaluations": evaluations, "prior_in_sample": error_summary(list(before.values())),
        "in_sample": error_summary(list(after.values())),
    }
    if loso:
        out["leave_one_source_out"] = leave_one_source_out(rows, start, fits)
    return out


def fit_task(task: tuple[str, str | None]) -> tuple[Params, int]:
    """One fit of `--jobs`: a generation's rows without one source (or all of them)."""
    generation, held_out = task
    rows = [r for r in fit_rows(generation) if r.row.source_id != held_out]
    return fit(rows, PRIOR[generation])


def all_fits(generations: Sequence[str], corpus: Sequence[CorpusRow], *, loso: bool, jobs: int) -> dict[str, Fits]:
    """Every fit the report needs, `jobs` at a time (each is deterministic, so the order is not)."""
    tasks: list[tuple[str, str | None]] = []
    for generation in generations:
        sources = sorted({r.row.source_id for r in fit_rows(generation, corpus)}) if loso else []
        sources = sources if len(sources) > 1 else []  # one source: no held-out fit ([Note: leave one source out])
        tasks += [(generation, None), *((generation, source) for source in sources)]
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs) as pool:
            done = list(pool.map(fit_task, sorted(tasks, key=lambda t: t[0] != "A100")))
        done = [done[sorted(tasks, key=lambda t: t[0] != "A100").index(t)] for t in tasks]
    else:
        done = [fit_task(t) for t in tasks]
    out: dict[str, Fits] = {}
    for (generation, held_out), result in zip(tasks, done, strict=True):
        out.setdefault(generation, {})[held_out] = result
    return out


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 6) for k, v in values.items()}


def _row_order(row_id: str) -> tuple[str, int]:
    match = re.fullmatch(r"(\D*)(\d+)", row_id)
    return (match.group(1), int(match.group(2))) if match else (row_id, 0)


def row_ranges(row_ids: Sequence[str]) -> str:
    """`p001-p003, p007`: consecutive ids as ranges, for the provenance strings."""
    parts: list[list[str]] = []
    last: tuple[str, int] | None = None
    for row_id in sorted(row_ids, key=_row_order):
        key = _row_order(row_id)
        if parts and last is not None and key == (last[0], last[1] + 1):
            parts[-1][1] = row_id
        else:
            parts.append([row_id, row_id])
        last = key
    return ", ".join(a if a == b else f"{a}-{b}" for a, b in parts)


def preset_document(doc: dict[str, Any], generation: str, result: dict[str, Any]) -> dict[str, Any]:
    """The preset's JSON with the fitted numbers, their provenance and the values they replace."""
    params, tag = result["params"], f"fitted: published_runs (rows {row_ranges(result['rows'])})"
    nominal = doc.get("gpu_nominal_tflops") or doc["gpu_peak_tflops"]
    doc = json.loads(json.dumps(doc))
    sources, citations = doc.setdefault("sources", {}), doc.setdefault("citations", {})
    why = f"fitted on {len(result['rows'])} {generation} rows of data/validation/published_runs.csv " \
          "(python -m planner.validation.fit --write; docs/planner.md, Fitted presets)"
    fitted = {"gpu_peak_tflops": round(params["plateau"] * nominal, 1),
              "hbm_achievable_fraction": round(params["hbm"], 4)}
    if doc.get("flash_attention_tflops"):
        fitted["flash_attention_tflops"] = round(params["flash"] * nominal, 1)
    fp8_nominal = FP8_DENSE_TFLOPS.get(doc["name"], (0.0,))[0]
    if params.get("fp8") and fp8_nominal:
        fitted["fp8_matmul_tflops"] = round(params["fp8"] * fp8_nominal, 1)
    kept = _kept(result)
    for key, value in fitted.items():
        before = _unfitted(citations.get(key, ""), doc.get(key), sources.get(key, "nominal"), key)
        doc[key], sources[key] = value, tag
        citations[key] = f"{why}{kept.get(key, '')}; before fitting: {before}"
    doc.setdefault("efficiency", {})["matmul"] = [{"gflop": g, "efficiency": e / 1}
                                                  for g, e in ((s / 1e9, e) for s, e in
                                                               matmul_curve(params["half_gflop"]).points)]
    sources["efficiency"] = tag
    citations["efficiency"] = f"matmul curve size / (size + {params['half_gflop']:.4g} GFLOP) {why}" \
                              f"{kept.get('efficiency', '')}; the transfer curve is the hand-set estimate"
    return doc


def _kept(result: dict[str, Any]) -> dict[str, str]:
    """Preset key -> a note for the numbers the fit left at the prior ([Note: which parameters the rows
    free]): a freed number lands on the prior's value to 6 decimals only by accident."""
    keys = {"plateau": "gpu_peak_tflops", "half_gflop": "efficiency", "flash": "flash_attention_tflops",
            "hbm": "hbm_achievable_fraction", "fp8": "fp8_matmul_tflops"}
    prior = result.get("prior", {})
    return {keys[name]: ", which kept the hand-set value: the rows do not pin it down" for name in keys
            if name in prior and result["params"][name] == prior[name]}


UNSET: dict[str, str] = {
    "hbm_achievable_fraction": "unset (planner/cost/kernels.py HBM_ACHIEVABLE_FRACTION, 0.83)",
    "fp8_matmul_tflops": "unset (gpu_peak_tflops times the datasheet's fp8 / bf16 ratio, planner/cost/fp8.py)",
}
"""What a fitted key a preset did not have stood for before its first fit."""


def _unfitted(citation: str, value: Any, source: str, key: str) -> str:
    """What a fitted number replaced: the first fit's record of it is kept on later fits."""
    marker = "; before fitting: "
    if marker in citation:
        return citation.split(marker, 1)[1]
    return f"{value} ({source})" if value is not None else UNSET[key]


def write(results: dict[str, dict[str, Any]], hardware_dir: Path = HARDWARE_DIR, fit_json: Path = FIT_JSON) -> list[Path]:
    """Write the fitted presets and the fit's record (`planner validate` reports from it); generations
    not in `results` keep their record."""
    written = []
    for generation, result in results.items():
        for name in GENERATIONS[generation][1]:
            path = hardware_dir / f"{name}.json"
            doc = preset_document(json.loads(path.read_text()), generation, result)
            NodeSpec.from_dict(doc, str(path))  # refuse to write a preset the planner would not load
            path.write_text(json.dumps(doc, indent=2) + "\n")
            written.append(path)
    # A fit of some generations (`--gpu`) keeps the others' records as they are.
    record = json.loads(fit_json.read_text()) if fit_json.exists() else {}
    record.update(results)
    fit_json.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return [*written, fit_json]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the fitted presets and data/validation/fit.json")
    parser.add_argument("--gpu", choices=sorted(GENERATIONS), action="append", help="only this generation (repeatable)")
    parser.add_argument("--no-loso", action="store_true", help="skip leave-one-source-out (in-sample fit only)")
    parser.add_argument("--jobs", type=int, default=1, help="fits run in parallel (processes)")
    args = parser.parse_args(argv)
    corpus, results, start = load_corpus(), {}, time.perf_counter()
    generations = args.gpu or list(GENERATIONS)
    fits = all_fits(generations, corpus, loso=not args.no_loso, jobs=max(1, args.jobs))
    for generation in generations:
        results[generation] = fit_generation(generation, corpus, loso=not args.no_loso, fits=fits[generation])
        print(_line(generation, results[generation], time.perf_counter() - start))
    if args.write:
        for path in write(results):
            print(f"wrote {path.relative_to(ROOT)}")


def _line(generation: str, result: dict[str, Any], wall_s: float) -> str:
    def pct(group: dict[str, Any]) -> str:
        if not group["rows"]:
            return "no rows"
        return f"median |error| {group['median_abs_error']:.1%}, p90 {group['p90_abs_error']:.1%} ({group['rows']} rows)"

    loso = result.get("leave_one_source_out")
    text = (f"{generation}: params {result['params']}; before {pct(result['prior_in_sample'])}; "
            f"in-sample {pct(result['in_sample'])}")
    if loso:
        text += f"; leave-one-source-out {pct(loso['summary']) if loso['summary'] else loso['not_defined']}"
    return text + f" [{wall_s:.0f} s]"


if __name__ == "__main__":
    main()
