"""Calibration: fit a hardware spec's efficiency parameters to measured profiles (`planner calibrate`).

Each profiled plan is simulated on the base spec, and again with each fitted rate slowed a little;
what each phase's simulated time owes each rate is a feature, and a non-negative least-squares fit
of the measured phase times on those features gives one factor per rate ([Note: the calibration
model], above `calibrate`). The fitted spec is the base spec with its rates divided by those
factors; `residual` and `standard_errors` say how well the profiles pin them down. The backward's
matmuls have a factor of their own ([Note: the backward's own matmul rate], above `phase_features`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.hardware import EfficiencyCurve, NodeSpec, document_key
from planner.specs.phases import Phase
from planner.specs.plan import Plan
from planner.specs.profile import Profile
from planner.specs.training_loop import step_overlaps_forward

FEATURES = ("compute_s", "backward_matmul_s", "memory_s", "cpu_adam_s", "nvme_s", "operators")
RATES: dict[str, tuple[str, ...]] = {
    "compute_s": ("gpu_flops_per_s", "flash_attention_flops_per_s"),
    "backward_matmul_s": ("backward_matmul_flops_per_s",),
    "memory_s": ("gpu_hbm_bytes_per_s",),
    "cpu_adam_s": ("cpu_adam_params_per_s",),
    "nvme_s": ("nvme_read_bytes_per_s", "nvme_write_bytes_per_s"),
}
"""Feature -> the spec's rates its factor divides (the per-operator cost, `operators`, is absolute)."""


@dataclass(frozen=True, slots=True)
class Calibration:
    node: NodeSpec
    """The base spec with the fitted parameters."""
    factors: dict[str, float]
    """theta per feature (seconds per feature second of the base spec; `operators`: seconds per operator)."""
    residual: float
    """Relative RMS error over all (profile, phase) rows: of the fitted linear model, or, where the search
    below the linear fit set the factors ([Note: relinearised where the step overlaps]), of the spec's
    own simulation."""
    num_rows: int
    standard_errors: dict[str, float] = field(default_factory=dict)
    """Standard error of each nonzero factor (see [Note: the calibration model]); nan where the
    rows leave no degree of freedom."""
    fitted: tuple[str, ...] = ()
    """The features some row depends on (the rates `node` took from the fit)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of `planner calibrate --json` and the sweep (a NaN standard error is null)."""
        return {"factors": dict(self.factors),
                "standard_errors": {k: None if math.isnan(v) else v for k, v in self.standard_errors.items()},
                "loose_factors": loose_factors(self), "residual": self.residual, "num_rows": self.num_rows,
                "hardware": self.node.to_dict()}


SLOWED_BY = 0.01
"""Each rate is slowed by this share to measure what a phase's simulated time owes it ([Note: the
calibration model])."""
ROUNDING = 1e-9
"""A phase time's relative change below this is the simulator's floating-point rounding, not a dependence."""
OPERATOR_PROBE_S = 1e-5
"""The per-operator cost, in seconds, whose effect on each phase counts the operators on its critical path."""


# [Note: the backward's own matmul rate] The backward's matmuls (input and weight gradients, twice
# the forward's flops) have a rate of their own, `backward_matmul_tflops`, which the spec leaves
# unset (the forward's) until a fit sets it: on a CPU they run slower per flop than the forward's,
# while a recomputed forward runs faster than the forward (torch.profiler,
# docs/notes/2026-11-26-calibration-sensitivities.md). With one compute factor the reference runs,
# which all recomputed, fitted the two errors against each other (a fast recompute and a slow
# backward in one row) and every plan without recompute came out fast in backward. With the
# backward's rate apart, and one reference run without recompute whose backward row is the backward
# alone (planner/calibration/probe_reference.py), the backward gets its own factor. GPU presets have
# none: cuBLAS runs both passes' GEMMs at the same rate, and the published runs pin one compute rate.
def phase_features(plan: Plan, node: NodeSpec) -> dict[str, dict[str, float]]:
    """Per phase, the seconds of its simulated time under `node` (no matmul curve, no per-operator
    cost) each fitted rate carries, `fixed_s` the rest ([Note: the calibration model])."""
    # The backward's matmul rate made explicit, so that slowing the forward's leaves it where it is.
    bare = node.replace(matmul_efficiency=EfficiencyCurve(), operator_overhead_s=0.0,
                        backward_matmul_flops_per_s=node.backward_matmul_rate)
    base = _phase_times(plan, bare)
    out: dict[str, dict[str, float]] = {phase: {} for phase in base}
    for feature in FEATURES:
        slowed, scale = _slowed(bare, feature)
        for phase, t in _phase_times(plan, slowed).items():
            grew = t - base[phase]  # rounding, where the phase does not wait for this rate at all
            out[phase][feature] = grew / scale if abs(grew) > ROUNDING * base[phase] else 0.0
    for phase, t in base.items():
        out[phase]["fixed_s"] = t - sum(out[phase][f] for f in FEATURES if f != "operators")
    return out


def _phase_times(plan: Plan, node: NodeSpec) -> dict[str, float]:
    from planner.cost.feasibility import check_plan
    from planner.sim.report import simulate

    # `node` may be another machine's spec (`planner calibrate --hardware`): the plan is checked on it.
    return dict(simulate(check_plan(plan.replace(node=node, prediction=None))).prediction.phase_time_s)


def _slowed(node: NodeSpec, feature: str) -> tuple[NodeSpec, float]:
    """`node` with the rates behind `feature` slowed by `SLOWED_BY` (what `calibrated_node` divides
    by that feature's factor), and what one unit of the feature is in that change."""
    if feature == "operators":
        return node.replace(operator_overhead_s=OPERATOR_PROBE_S), OPERATOR_PROBE_S
    return node.replace(**_divided(node, feature, 1 + SLOWED_BY)), SLOWED_BY


def _divided(node: NodeSpec, feature: str, factor: float) -> dict[str, float]:
    """The rates behind `feature` (`RATES`) divided by `factor`; a fused attention kernel's only where
    the spec has one."""
    effective = {"backward_matmul_flops_per_s": node.backward_matmul_rate}  # 0 there means the forward's
    return {rate: effective.get(rate, getattr(node, rate)) / factor for rate in RATES[feature]
            if rate != "flash_attention_flops_per_s" or node.flash_attention_flops_per_s}


def _nnls(rows: list[list[float]], targets: list[float]) -> tuple[list[float], float]:
    """Exact non-negative least squares for a handful of columns: the best unconstrained fit over
    every subset of columns whose solution is non-negative (2^k small solves)."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    k = a.shape[1]
    best, best_err = [0.0] * k, float(np.sum(b * b))
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sub = a[:, cols]
            if not np.any(sub):
                continue
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - b) ** 2))
            if err < best_err - 1e-15:
                best = [0.0] * k
                for c, v in zip(cols, x, strict=True):
                    best[c] = float(v)
                best_err = err
    return best, best_err


# [Note: the calibration model] For every profiled plan the simulator is run on the *base* spec with
# its matmul efficiency curve and per-operator cost removed, and again with each fitted rate slowed by
# 1 % (`SLOWED_BY`); how much each phase's simulated time (forward; backward = recompute + backward;
# optimizer, as the profile times them) grows says how many of its seconds that rate carries:
#
#     compute_s      gpu_peak_tflops (and flash_attention_tflops): the forward's and the recompute's
#     backward_matmul_s  backward_matmul_tflops                 (the backward's matmuls, below)
#     memory_s       gpu_hbm_gb_per_s                           (planner/sim/workload.py [Note: elementwise work])
#     cpu_adam_s     cpu_adam_gparams_per_s                     (CPU Adam on the CPU optimizer)
#     nvme_s         the NVMe read and write rates
#     operators      the per-operator cost, counted per second  (the operators on the phase's critical path)
#     fixed_s        the rest of the phase: what no fitted rate carries (host copies, PCIe, collectives)
#
# The measured phase time is modelled as `fixed_s + sum_f theta_f * feature_f` with every
# `theta >= 0` (non-negative least squares, each row divided by its measured time so that every phase
# of every profile weighs the same relative error). The features are the simulated phase time's
# derivatives in its rates (times the rate): a rate whose work hides behind another's (NVMe reads
# behind the compute they prefetch for, CPU Adam behind the chunk reads of an I/O-bound step) carries
# none of the phase's time, as in the simulator, and where the simulator is right `theta = 1`
# reproduces its phase times exactly (a phase time is the sum of its critical path's pieces, each a
# rate's work over the rate). Busy times would add what the
# simulator overlaps: fitted on an NVMe run whose step is I/O-bound they price its CPU Adam and its
# reads as a sum, and the simulator then predicts other plans with NVMe rates fitted faster than the
# drive (docs/notes/2026-11-26-calibration-loop-quiet-machine.md). The fitted spec is the
# base spec with
# - `gpu_peak_tflops / theta_compute` (and `flash_attention_tflops`), `gpu_hbm_gb_per_s / theta_memory`,
#   and no matmul efficiency curve (the features were taken without one),
# - `cpu_adam_gparams_per_s / theta_cpu_adam`, NVMe read and write rates `/ theta_nvme`,
# - `operator_overhead_ms = 1000 * theta_operators` (absolute: the feature counts operators).
#
# `operators` is the runtime's fixed cost per operator (one unit gathered, its hooks run, released;
# the framework's dispatch), fitted in seconds per operator as `operator_overhead_ms`. It is what
# tiling costs: tiling `t` runs `t` operators where one ran, with the same flops and bytes, which no
# other feature charges. Fitted on runs that never vary the operator count apart from the bytes it is
# noise, so the probe's reference runs include a tiled one (planner/calibration/probe_reference.py) and the fit
# can tell the cost from the rates (tests/test_calibrate_probe.py fits a known cost back from
# simulated reference runs). Measurements: docs/notes/2026-11-23-calibration-operator-cost.md.
# A feature no profile exercises (all zeros) keeps the base value. The model is linear about the
# base spec: a fitted factor far from 1 can move which resource bounds a phase, which the features
# taken at the base do not see; the simulator with the fitted spec does. `residual` is the fit's
# relative RMS error over all rows; `planner compare --hardware` shows the simulator's own error
# before and after.
# `standard_errors` are each fitted factor's (the least-squares covariance of the factors the fit
# kept, scaled by the residual): a factor whose error is a large share of its value is one the
# profiles do not pin down. Profiles that never change one term independently of another (untiled
# runs only: operators and memory-bound bytes both grow with layers and tokens) can trade one for
# the other; calibrate on runs that vary each term, as the probe's reference runs do.
# [Note: the overlapped step is one row with the forward] The runtime runs an after-backward step
# whose states stream from NVMe on the optimizer worker during the next forward, where the CPU is the
# compute device (`step_overlaps_forward`; runtime/optim/step_schedule.py [Note: the step overlaps the
# next forward]). Its profile counts to `optimizer` only the host's waits for an update; the rest of
# the step's cost lands in the forward, which shares the cores with CPU Adam and the drive with the
# step's state I/O. Which of the two phases holds it depends on how the contention falls, not on a
# rate, so calibration fits their sum: per phase it would ask the forward's features to explain the
# step's Adam and I/O, and the optimizer phase's to explain almost nothing.
# [Note: relinearised where the step overlaps] An overlapped step hides the drive under the forward
# while the forward's compute is the longer, and exposes it once the drive is: its row is a max, not a
# sum, and the features (slopes at the spec's rates) are those of whichever side is longer there. A
# drive found slower than the spec moves that row onto the other slope, so where a plan overlaps its
# step and the fitted spec's own simulation misses the runs (`model_residual`), `calibrate` fits again
# at the fitted rates (Gauss-Newton steps, at most `MAX_RELINEARISATIONS`) and composes the fits: each
# rate divided by every factor, the floors kept on the product. A step is kept only where its spec's
# own simulation misses the runs less than the last: where the drive hides, a further fit may move
# its factor along a flat row. Where the steps stall short of the runs (the max's kink: the slopes on
# either side disagree, so Gauss-Newton stops beside the minimum), a coordinate search on the factors'
# logs minimises the spec's own simulated miss directly (`_searched`).
def calibrate(runs: list[tuple[Plan, Profile]], node: NodeSpec) -> Calibration:
    """Fit `node`'s efficiency parameters to the runs (see [Note: the calibration model])."""
    if not runs:
        raise PlannerError("calibrate needs at least one profile")
    floors, merged = factor_floors(node), shares_cores(node)
    fit = _fit(runs, node, floors, merged=merged)
    if not any(step_overlaps_forward(plan) for plan, _ in runs):
        return fit
    missed = model_residual(runs, fit.node)
    for _ in range(MAX_RELINEARISATIONS):
        if missed <= CONSISTENT:
            break  # the fitted spec predicts the runs: nothing to relinearise
        step = _relinearised(runs, node, fit, floors, merged=merged)
        step_missed = model_residual(runs, step.node)
        if step_missed >= missed:
            break  # the drive hides: a further fit would move its factor along a flat row
        fit, missed = step, step_missed
    return fit if missed <= CONSISTENT else _searched(runs, node, fit, floors, missed)


MAX_RELINEARISATIONS = 4
"""Gauss-Newton steps at most where a plan overlaps its step ([Note: relinearised where the step
overlaps]); each keeps only a spec whose own simulation misses the runs less than the last."""


SEARCH_STEPS = (0.1, 0.03, 0.01, 0.003)
"""Log-space steps of the coordinate search on the factors, coarse to fine ([Note: relinearised where the
step overlaps])."""
MAX_SEARCH_EVALUATIONS = 400
"""Simulations of the runs the search may spend (each a few milliseconds on the probe's small models)."""


def _searched(runs: list[tuple[Plan, Profile]], node: NodeSpec, fit: Calibration, floors: dict[str, float],
              missed: float) -> Calibration:
    """Coordinate search on the log of each fitted rate factor for the spec whose own simulation misses
    the runs least, from `fit` (which misses them by `missed`): where the drive hides under the forward
    the overlapped row is a max, whose slopes a linear fit cannot follow to its kink. The standard
    errors stay the last linear fit's: the search has no slopes of its own to give others."""
    theta, fitted = dict(fit.factors), set(fit.fitted)
    names = [f for f in FEATURES if f != "operators" and theta.get(f, 0.0) > 0]
    evaluations = 0
    for step in SEARCH_STEPS:
        improved = True
        while improved and evaluations < MAX_SEARCH_EVALUATIONS:
            improved = False
            for name, sign in itertools.product(names, (-1.0, 1.0)):
                trial = {**theta, name: theta[name] * math.exp(sign * step)}
                if trial[name] < floors.get(name, 0.0):
                    continue
                evaluations += 1
                trial_missed = model_residual(runs, calibrated_node(node, trial, fitted))
                if trial_missed < missed:
                    theta, missed, improved = trial, trial_missed, True
    return Calibration(node=calibrated_node(node, theta, fitted), factors=theta, residual=missed,
                       num_rows=fit.num_rows, fitted=fit.fitted, standard_errors=fit.standard_errors)


def _relinearised(runs: list[tuple[Plan, Profile]], node: NodeSpec, fit: Calibration, floors: dict[str, float], *,
                  merged: bool) -> Calibration:
    """One more fit at `fit`'s rates, composed with it: each rate of `node` divided by both factors."""
    first = fit.factors
    at_fit = calibrated_node(node, first, set(fit.fitted))
    second = _fit(runs, at_fit, {f: floor / first[f] if first.get(f, 0.0) > 0 else floor for f, floor in floors.items()},
                  merged=merged)
    theta = {f: second.factors[f] if f == "operators" else _composed(first[f], second.factors[f]) for f in FEATURES}
    fitted = tuple(sorted(set(fit.fitted) | set(second.fitted)))
    return Calibration(node=calibrated_node(node, theta, set(fitted)), factors=theta, residual=second.residual,
                       num_rows=second.num_rows, fitted=fitted,
                       standard_errors={f: se * (first[f] if f != "operators" and first[f] > 0 else 1.0)
                                        for f, se in second.standard_errors.items()})


CONSISTENT = 1e-3
"""A fitted spec whose simulated phases are within this relative RMS of the runs' needs no second fit."""


def model_residual(runs: list[tuple[Plan, Profile]], node: NodeSpec) -> float:
    """Relative RMS error of `node`'s simulated phase times against the runs', over the rows `calibrate`
    fits (the overlapped step's with the forward's)."""
    errors = []
    for plan, profile in runs:
        predicted, measured = _phase_times(plan, node), dict(profile.measured.phase_time_s)
        if step_overlaps_forward(plan):
            measured[Phase.FORWARD] += measured.pop(Phase.OPTIMIZER)
            predicted[Phase.FORWARD] += predicted.pop(Phase.OPTIMIZER)
        errors += [(predicted[phase] - t) / t for phase, t in measured.items() if t > 0 and phase in predicted]
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


def _composed(first: float, second: float) -> float:
    """A rate's factor after two fits: the second divides what the first left (a factor 0 leaves the rate)."""
    if first <= 0:
        return second
    return first * second if second > 0 else first


def _fit(runs: list[tuple[Plan, Profile]], node: NodeSpec, floors: dict[str, float], *, merged: bool) -> Calibration:
    """One least-squares fit of the features at `node`'s rates, each factor at least its floor;
    `merged`: the compute and memory-bound features are one ([Note: one factor for the CPU's kernels])."""
    rows, targets = [], []
    for plan, profile in runs:
        features = phase_features(plan, node)
        if merged:
            for phase in features.values():
                phase["compute_s"], phase["memory_s"] = phase["compute_s"] + phase["memory_s"], 0.0
        measured_s = dict(profile.measured.phase_time_s)
        if step_overlaps_forward(plan):  # [Note: the overlapped step is one row with the forward]
            measured_s[Phase.FORWARD] += measured_s.pop(Phase.OPTIMIZER)
            step = features.pop(Phase.OPTIMIZER)
            features[Phase.FORWARD] = {f: s + step[f] for f, s in features[Phase.FORWARD].items()}
        for phase, measured in measured_s.items():
            if measured <= 0 or phase not in features:
                continue
            rows.append([features[phase][f] / measured for f in FEATURES])
            targets.append(1.0 - features[phase]["fixed_s"] / measured)
    if not rows:
        raise PlannerError("the profiles carry no positive phase times to calibrate on")
    targets = [t - sum(floors.get(f, 0.0) * r[j] for j, f in enumerate(FEATURES)) for r, t in zip(rows, targets, strict=True)]
    used = [j for j in range(len(FEATURES)) if any(r[j] for r in rows)]
    theta_used, err = _nnls([[r[j] for j in used] for r in rows], targets)
    theta = dict.fromkeys(FEATURES, 0.0)
    for j, v in zip(used, theta_used, strict=True):
        theta[FEATURES[j]] = floors.get(FEATURES[j], 0.0) + v
    active = [j for j in used if theta[FEATURES[j]] > 0]
    fitted = tuple(FEATURES[j] for j in used)
    return Calibration(node=calibrated_node(node, theta, set(fitted)), factors=theta,
                       residual=math.sqrt(err / len(rows)), num_rows=len(rows), fitted=fitted,
                       standard_errors=_standard_errors([[r[j] for j in active] for r in rows], err,
                                                        [FEATURES[j] for j in active]))


def factor_floors(node: NodeSpec) -> dict[str, float]:
    """[Note: a drive runs no faster than the probe measured it] The probe times the drive through
    the runtime's own I/O engine in large requests (runtime/probe.py `measure_nvme`): the runtime's
    chunk reads and writes cannot move bytes faster. A reference run whose phases took less than
    the simulator's NVMe time says that part of it overlapped something the simulator runs apart
    (the overlapped step, [Note: the overlapped step is one row with the forward]), not that the
    drive sped up; fitted freely, one such run priced every other plan's NVMe traffic faster than the
    drive (docs/notes/2026-11-26-calibration-sensitivities.md). So where the rates
    are `measured`, `theta_nvme >= 1`: the fit may find the runtime slower, never faster."""
    measured = node.sources.get("nvme_read_gb_per_s") == node.sources.get("nvme_write_gb_per_s") == "measured"
    return {"nvme_s": 1.0} if measured else {}


LOOSE_SHARE = 0.5
"""A factor whose standard error is more than this share of its value (t < 2) is loosely determined."""


def loose_factors(result: Calibration) -> list[str]:
    """The fitted factors the profiles do not pin down (standard error over `LOOSE_SHARE` of the value)."""
    return [name for name, se in result.standard_errors.items()
            if math.isfinite(se) and se > LOOSE_SHARE * result.factors[name]]


def _standard_errors(rows: list[list[float]], err: float, names: list[str]) -> dict[str, float]:
    """Least-squares standard errors of the kept factors: sqrt(diag(s^2 (A^T A)^-1)), s^2 = err / dof."""
    import numpy as np

    dof = len(rows) - len(names)
    if not names or dof <= 0:
        return dict.fromkeys(names, math.nan)
    a = np.asarray(rows, dtype=float)
    cov = (err / dof) * np.linalg.pinv(a.T @ a)
    return {name: float(math.sqrt(max(0.0, cov[i, i]))) for i, name in enumerate(names)}


def shares_cores(node: NodeSpec) -> bool:
    """[Note: one factor for the CPU's kernels] Where the CPU is the compute device and the probe
    measured its memory-bound kernels (`hbm_achievable_fraction` sourced `measured`) next to its
    matmuls and fused attention, one factor scales all three.

    The matmuls, the fused attention and the norms, activations and residual adds run on the same
    cores, one after the other, so whatever else runs on the machine slows them alike, and the
    probe times all three back to back: their ratios are measured, and what the reference runs
    add is how fast the cores ran for training. Fitted apart, the matmul and memory-bound columns
    are nearly collinear over four small runs (both grow with tokens x width), and on a shared
    machine whose speed moves within a minute the fit trades one for the other at random (it can
    price matmuls at zero, which times every backward, 2x the forward's matmuls and 1.5x its kernel
    bytes, short: docs/notes/2026-11-25-calibration-loop-outside-sweep.md). A GPU keeps the two
    factors: its matmuls and its HBM are different units."""
    return node.host_is_device and node.sources.get("hbm_achievable_fraction") == "measured"


def calibrated_node(node: NodeSpec, theta: dict[str, float], fitted: set[str]) -> NodeSpec:
    changes: dict[str, Any] = {}
    for feature in RATES:
        if feature in fitted and theta[feature] > 0:
            changes.update(_divided(node, feature, theta[feature]))
            if feature in ("compute_s", "backward_matmul_s"):  # their features were taken without the curve
                changes["matmul_efficiency"] = EfficiencyCurve()
            if feature == "compute_s" and shares_cores(node):  # [Note: one factor for the CPU's kernels]
                changes.update(_divided(node, "memory_s", theta[feature]))  # a fitted memory_s follows
    if "operators" in fitted:
        changes["operator_overhead_s"] = theta["operators"]
    sources = dict(node.sources)
    sources.update({document_key(k): "measured" for k in changes})
    note = ("Calibrated by `planner calibrate` (planner/calibration/calibrate.py [Note: the calibration model]): factors "
            + ", ".join(f"{k} {theta[k]:.4g}" for k in FEATURES if k in fitted) + ".")
    return node.replace(**changes, sources=sources, notes=(node.notes + " " + note).strip(),
                        name=f"{node.name}-calibrated" if not node.name.endswith("-calibrated") else node.name)


def calibration_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Error summary of sweep rows (`measured_s`, `predicted_s`, optional `calibrated_s`), split into
    the calibration set and the held-out set, and over all rows (`predicted_all`, `calibrated_all`)."""
    out: dict[str, Any] = {}
    for key in ("predicted_s", "calibrated_s"):
        for split, wanted in (("held_out", False), ("calibration", True), ("all", None)):
            errs = sorted(abs(r[key] - r["measured_s"]) / r["measured_s"] for r in rows
                          if key in r and wanted in (None, r["calibration"]))
            if errs:
                out[f"{key.removesuffix('_s')}_{split}"] = {
                    "median_abs_error": statistics.median(errs), "worst_abs_error": errs[-1], "count": len(errs)}
    return out
