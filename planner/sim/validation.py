"""Simulate every experiment configuration of the paper on `dgx2-v100` and tabulate the predictions.

Source of the configurations: Rajbhandari et al., "ZeRO-Infinity", SC21 (arXiv 2104.07857), as
summarised in docs/method.md §5 ("Experiment configs"). docs/method.md does not carry the paper's measured
TFLOPS/GPU, so the table shows only our predictions beside each configuration.

Also the strategy comparison (six strategies x six models on one DGX-2) and the tiling study
(one-layer models under a 2 GiB largest allocation) of the same section.

Run: `python -m planner.sim.validation --out docs/validation.md`

Choices the table leaves open, made once here:
- models are the presets of data/models/paper.json (widths in the paper's K = 1024, 18K = 18432);
- gradients follow the optimizer (GPU with a GPU optimizer, NVMe when parameters are on NVMe, CPU
  otherwise); recompute inputs on the GPU when everything else is and they fit, on the CPU
  otherwise; the smallest tiling factor that fits (memory-centric tiling, docs/method.md §4.4);
  one recompute segment per block (ci = 1); prefetch depth 3; bf16; the plan's default optimizer chunk
  (256 MiB) and 3 buffers.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from planner.sim.fast import predict
from planner.sim.report import simulate
from planner.specs.catalog import hardware_presets, model_presets
from planner.specs.model import ModelSpec
from planner.specs.phases import PHASES
from planner.specs.plan import STRATEGY_TABLE, Placement, Plan, Prediction
from planner.specs.tiers import GPU, HOST, NVME, TIERS, Tier
from planner.specs.units import GIB

HARDWARE = "dgx2-v100"


@dataclass(frozen=True, slots=True)
class Experiment:
    nodes: int
    label: str
    hidden: int
    layers: int
    batch_per_gpu: float
    mp: int
    params_on: Tier
    optimizer_on: Tier
    preset: str
    """Model preset in data/models/paper.json with this width and depth."""


K = 1024
EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(1, "10B", 4 * K, 50, 8, 1, GPU, GPU, preset="paper-10b"),
    Experiment(1, "50B", 8 * K, 62, 26, 1, HOST, NVME, preset="paper-50b"),
    Experiment(1, "100B", 8 * K, 125, 24, 1, HOST, NVME, preset="paper-100b"),
    Experiment(1, "0.5T", 18 * K, 124, 8, 1, NVME, NVME, preset="paper-0.5t-exp"),
    Experiment(1, "1T", 25600, 128, 7, 1, NVME, NVME, preset="paper-1t-exp"),
    Experiment(32, "0.5T", 18 * K, 124, 7, 4, GPU, GPU, preset="paper-0.5t-exp"),
    Experiment(32, "1T", 25600, 128, 5, 4, GPU, GPU, preset="paper-1t-exp"),
    Experiment(32, "5T", 48 * K, 174, 3, 4, NVME, NVME, preset="paper-5t"),
    Experiment(32, "10T", 64 * K, 200, 2, 4, NVME, NVME, preset="paper-10t-exp"),
    Experiment(32, "20T", 88 * K, 205, 1.25, 8, NVME, NVME, preset="paper-20t"),
)


def experiment_plan(exp: Experiment) -> Plan:
    """The configuration with the first recompute-input tier (GPU, then CPU) and the smallest tiling
    factor (1, 2, 4, ... 64) whose simulated memory fits; the last one tried when none does."""
    candidates = [
        _plan(exp, inputs_on, tiling)
        for inputs_on in ((GPU, HOST) if exp.params_on.on_device and exp.optimizer_on.on_device else (HOST,))
        for tiling in (1, 2, 4, 8, 16, 32, 64)
    ]
    for plan in candidates:
        if predict(plan).feasible:
            return plan
    return candidates[-1]


def _plan(exp: Experiment, inputs_on: Tier, tiling: int) -> Plan:
    node = hardware_presets()[HARDWARE]
    model = model_presets()[exp.preset][0]
    assert (model.hidden_size, model.num_layers) == (exp.hidden, exp.layers), exp
    # Gradients beside GPU optimizer states; else on the parameters' staged tier (NVMe) with them, or in host memory.
    grads = exp.optimizer_on if exp.optimizer_on.on_device else (exp.params_on if exp.params_on.staged else HOST)
    placement = Placement(params=exp.params_on, gradients=grads, optimizer_states=exp.optimizer_on,
                          recompute_inputs=inputs_on)
    return Plan(model=model, node=node, num_gpus=exp.nodes * node.num_gpus_per_node, placement=placement,
                micro_batch_per_gpu=exp.batch_per_gpu, recompute_interval=1, model_parallel_degree=exp.mp,
                tiling_factor=tiling)


def render(rows: list[tuple[Experiment, Plan, object, float]]) -> str:
    lines = [
        "# Simulated predictions for the paper's experiment configurations",
        "",
        f"Hardware preset `{HARDWARE}` (docs/method.md §5; compute rates fitted on Megatron-LM 2019's V100 runs, which pin",
        "down the matmul rate only (docs/planner.md, Fitted presets); the transfer curve and NVMe read/write sharing are",
        "estimates, see `data/hardware/dgx2-v100.json`). Configurations: ZeRO-Infinity (Rajbhandari et al., SC21, arXiv 2104.07857)",
        "as listed in docs/method.md §5. docs/method.md does not give the paper's measured TFLOPS/GPU, so only our predictions",
        "are shown. TFLOPS follow the paper's accounting (eq. 7: 8 x tokens x params per iteration, recompute on).",
        "Peaks are the memory bill's (`planner.cost.memory`, which decides `fits`): GPU per GPU, CPU and NVMe per node. Generated by `python -m planner.sim.validation --out docs/validation.md`;",
        "assumptions in the module docstring of `planner/sim/validation.py`.",
        "",
        "| nodes | params | hd | layers | batch/GPU | mp | placement (P G O A) | tiling | iteration s | TFLOPS/GPU | tokens/s | "
        "fwd / bwd / opt s | bottleneck | GPU peak GiB | CPU peak GiB | NVMe GiB | fits | sim wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for exp, plan, p, wall in rows:
        phases = " / ".join(f"{p.phase_time_s[phase]:,.1f}" for phase in PHASES)
        placement = " ".join(plan.placement.to_dict().values())
        lines.append(
            f"| {exp.nodes} | {exp.label} ({plan.model.num_params / 1e9:,.0f}B) | {exp.hidden} | {exp.layers} | "
            f"{exp.batch_per_gpu:g} | {exp.mp} | {placement} | {plan.tiling_factor} | {p.iteration_time_s:,.1f} | {p.tflops_per_gpu:.1f} | "
            f"{p.tokens_per_s:,.0f} | {phases} | {p.bottleneck} | "
            f"{p.peak_bytes[GPU] / GIB:.1f} / {p.capacity_bytes[GPU] / GIB:.0f} | "
            f"{p.peak_bytes[HOST] / GIB:,.0f} / {p.capacity_bytes[HOST] / GIB:,.0f} | "
            f"{p.peak_bytes[NVME] / GIB:,.0f} / {p.capacity_bytes[NVME] / GIB:,.0f} | "
            f"{'yes' if p.feasible else 'no: ' + p.reason} | {wall:.2f} |"
        )
    return "\n".join(lines) + "\n"


# Strategy comparison on one DGX-2 (docs/method.md §5): (preset, batch/GPU, mp).
STRATEGY_MODELS: tuple[tuple[str, float, int], ...] = (
    ("paper-1.4b", 1, 1), ("paper-10b", 1, 1), ("paper-13b", 1, 1), ("paper-20b", 1, 1), ("paper-70b", 1, 1),
    ("paper-1t", 5, 4),
)
STRATEGIES = ("dp", "zero2", "zero-offload", "zero3", "zero-inf-cpu", "zero-inf-nvme")
TILING_STUDY_HIDDEN = (8 * K, 16 * K, 32 * K, 64 * K)
TILING_STUDY_MAX_ALLOC_GIB = 2.0


def _smallest_fitting_tiling(plan: Plan) -> tuple[Plan, Prediction]:
    """The plan at the smallest tiling factor (1, 2, 4, ... 64) that fits, or at 64."""
    for tiling in (1, 2, 4, 8, 16, 32, 64):
        candidate = plan.replace(tiling_factor=tiling)
        prediction = predict(candidate)
        if prediction.feasible:
            break
    return candidate, prediction


def strategy_table() -> str:
    node = hardware_presets()[HARDWARE]
    lines = ["## Strategy comparison on one DGX-2 (16 GPUs)", "",
             "Simulated TFLOPS/GPU per strategy (docs/method.md §5 strategy comparison: batch/GPU 1; 1000B with mp 4 and batch 5; "
             "ci 1; smallest tiling factor that fits). `-` marks a plan the memory bill rejects (tiers over capacity).", "",
             "| model | " + " | ".join(STRATEGIES) + " |", "|---|" + "---|" * len(STRATEGIES)]
    for preset, batch, mp in STRATEGY_MODELS:
        model = model_presets()[preset][0]
        cells = []
        for name in STRATEGIES:
            plan = Plan(model=model, node=node, num_gpus=node.num_gpus_per_node, strategy=name,
                        placement=STRATEGY_TABLE[name].placement, micro_batch_per_gpu=batch, recompute_interval=1,
                        model_parallel_degree=mp)
            plan, p = _smallest_fitting_tiling(plan)
            over = [t for t in TIERS if p.peak_bytes[t] > p.capacity_bytes[t]]
            cells.append(f"{p.tflops_per_gpu:.1f}" + (f" (tiling {plan.tiling_factor})" if plan.tiling_factor > 1 else "")
                         if p.feasible else f"- ({', '.join(over) or 'allocation'})")
        lines.append(f"| {preset} ({model.num_params / 1e9:,.1f}B, mp {mp}, batch {batch:g}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tiling_table() -> str:
    node = hardware_presets()[HARDWARE].replace(gpu_max_alloc_bytes=TILING_STUDY_MAX_ALLOC_GIB * GIB)
    lines = ["## Tiling study (one-layer models, 16 GPUs, batch 1, no allocation above 2 GiB)", "",
             "docs/method.md §5: GPU memory pre-fragmented into 2 GiB blocks. Placement ZeRO-Infinity CPU "
             "(all states offloaded to CPU memory), ci 1.", "",
             "| hd | largest linear (bf16) | fits untiled | smallest tiling that fits | simulated TFLOPS/GPU there |",
             "|---|---|---|---|---|"]
    for hidden in TILING_STUDY_HIDDEN:
        model = ModelSpec(name=f"one-layer-{hidden // K}k", num_layers=1, hidden_size=hidden, num_heads=hidden // 128)
        plan = Plan(model=model, node=node, num_gpus=16, strategy="zero-inf-cpu",
                    placement=STRATEGY_TABLE["zero-inf-cpu"].placement, micro_batch_per_gpu=1, recompute_interval=1)
        untiled = predict(plan)
        tiled, p = _smallest_fitting_tiling(plan)
        largest = model.largest_operator_params * 2 / GIB
        lines.append(f"| {hidden // K}K | {largest:,.1f} GiB | {'yes' if untiled.feasible else 'no'} | "
                     f"{tiled.tiling_factor if p.feasible else 'none up to 64'} | {p.tflops_per_gpu:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here (default: print it)")
    args = parser.parse_args(argv)
    rows = []
    for exp in EXPERIMENTS:
        plan = experiment_plan(exp)
        start = time.perf_counter()
        prediction = simulate(plan).prediction
        rows.append((exp, plan, prediction, time.perf_counter() - start))
    text = render(rows) + "\n" + strategy_table() + "\n" + tiling_table()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + _kept_tail(args.out))
    print(text, end="")


CORPUS_MARKER = "<!-- corpus validation:"
"""Where `python -m planner.validation.docs` starts its section: the paper's tables above it are
ours to rewrite, the corpus section and the notes after it are kept."""


def _kept_tail(path: Path) -> str:
    old = path.read_text() if path.exists() else ""
    at = old.find(CORPUS_MARKER)
    return "\n" + old[at:] if at >= 0 else ""


if __name__ == "__main__":
    main()
