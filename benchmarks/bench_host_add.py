"""Host-side passes over large gradients: `add_into` vs torch's mixed-dtype `add_`, and the loss
scaler's overflow check by sum vs `isfinite(...).all()`.

[Note: a mixed-precision add on the CPU] in runtime/transfer/mixed_add.py, [Note: an overflow check by sum]
in runtime/optim/loss_scaling.py. Three measurements, each pair alternating in one process so that
machine noise hits both alike:
- the add alone, at the sizes a unit's gradient comes in, bf16 and fp16 into fp32;
- the runtime's backward with gradient accumulation: the reference MLP's blocks (benchmarks/bench_runtime.py)
  at hidden 2048 and FFN 8192 (16 Mi weights a Linear), bf16, every state in host memory,
  `--micro-batches` backwards per optimizer step, so all but the first add into the shards; the
  same sharded model with the runtime's adds switched to torch's `add_` in between;
- the fp16 overflow check over one fp32 gradient shard, at the same sizes.
Both with glibc's thresholds set as a rank sets them (runtime/host_malloc.py).

    python benchmarks/bench_host_add.py [--reps 7] [--steps 4] [--micro-batches 4] [--write-results]

Prints one JSON document (rates in G elements/s, times in seconds, medians); `--write-results` also
replaces the `host_add` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import results_md
import torch
from bench_runtime import LR, TOKENS, build_model, plan_doc  # benchmarks/ is on sys.path

import runtime
import runtime.transfer.stores
from runtime.host_malloc import keep_freed_memory_mapped
from runtime.optim.loss_scaling import not_finite
from runtime.transfer.mixed_add import add_into

SIZES = (1 << 20, 1 << 23, 1 << 25)
HIDDEN_LARGE, FFN_LARGE, BLOCKS_LARGE, BATCH_LARGE = 2048, 8192, 2, 2


def torch_add(target: torch.Tensor, src: torch.Tensor) -> None:
    """The baseline: torch's own `add_` (on the CPU it casts the whole 16-bit operand into a new fp32
    tensor first)."""
    target.add_(src.to(target.device))


def isfinite_all(grad: torch.Tensor) -> torch.Tensor:
    """The baseline check: a bool tensor the size of the gradient, then `all`."""
    return torch.isfinite(grad).all().logical_not()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternating_medians(systems: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Median seconds of each system, its runs alternating with the others' (`reps` rounds after one
    warm-up round); each callable returns the seconds of one run."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for rep in range(reps + 1):
        for name, run in systems.items():
            elapsed = run()
            if rep:
                times[name].append(elapsed)
    return {name: statistics.median(v) for name, v in times.items()}


def _rate_row(numel: int, median: dict[str, float], baseline: str, ours: str) -> dict:
    return {"numel": numel, **{f"{k} Gelem/s": round(numel / v / 1e9, 3) for k, v in median.items()},
            "speedup": round(median[baseline] / median[ours], 2)}


def bench_add(reps: int) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for numel in SIZES:
            target, src = torch.zeros(numel), torch.randn(numel).to(dtype)
            median = alternating_medians({name: partial(_timed, partial(fn, target, src))
                                          for name, fn in (("torch add_", torch_add), ("add_into", add_into))}, reps)
            rows.append({"dtype": str(dtype).removeprefix("torch."), **_rate_row(numel, median, "torch add_", "add_into")})
    return rows


def bench_overflow_check(reps: int) -> list[dict]:
    rows = []
    for numel in SIZES:
        grad = torch.randn(numel)
        median = alternating_medians({name: partial(_timed, partial(fn, grad))
                                      for name, fn in (("isfinite().all()", isfinite_all), ("sum", not_finite))}, reps)
        rows.append(_rate_row(numel, median, "isfinite().all()", "sum"))
    return rows


def bench_accumulation(steps: int, micro_batches: int) -> dict:
    plan = plan_doc("cpu")
    plan["precision"] = "bf16"
    plan["model"].update(num_layers=BLOCKS_LARGE, hidden_size=HIDDEN_LARGE, ffn_hidden_size=FFN_LARGE)
    model = runtime.shard(build_model(HIDDEN_LARGE, FFN_LARGE, BLOCKS_LARGE), plan)
    opt = runtime.AdamW(model, lr=LR, weight_decay=0.0)
    torch.manual_seed(0)
    x, y = (torch.randn(BATCH_LARGE, TOKENS, HIDDEN_LARGE, dtype=torch.bfloat16) for _ in range(2))

    def step(add: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
        """One optimizer step with the stores adding by `add`: seconds of the backwards that
        accumulate (all but the first)."""
        runtime.transfer.stores.add_into = add
        accumulating = 0.0
        for micro in range(micro_batches):
            loss = model(x, y)
            elapsed = _timed(loss.backward)
            accumulating += elapsed if micro else 0.0
        opt.step()
        opt.zero_grad()
        return accumulating

    try:
        median = alternating_medians({"torch add_": partial(step, torch_add), "add_into": partial(step, add_into)}, steps)
    finally:
        runtime.transfer.stores.add_into = add_into
    return {"model": f"{BLOCKS_LARGE} x (LayerNorm, Linear({HIDDEN_LARGE}, {FFN_LARGE}), Linear({FFN_LARGE}, {HIDDEN_LARGE}))",
            "batch": f"{BATCH_LARGE} x {TOKENS}", "micro_batches": micro_batches, "steps": steps,
            **{f"{k} accumulating backward s": round(v / (micro_batches - 1), 4) for k, v in median.items()},
            "speedup": round(median["torch add_"] / median["add_into"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    keep_freed_memory_mapped()
    machine = results_md.measure_machine(torch=True)
    doc = {"add": bench_add(args.reps), "accumulation": bench_accumulation(args.steps, args.micro_batches),
           "overflow_check": bench_overflow_check(args.reps)}
    doc["machine"] = machine.finish().to_dict()
    print(json.dumps(doc, indent=1))
    if args.write_results:
        results_md.write_section("host_add", markdown(doc, machine))


def markdown(doc: dict, machine: results_md.MachineFacts) -> str:
    acc = doc["accumulation"]
    lines = ["## Host-side passes over gradients (`benchmarks/bench_host_add.py`)", "",
             f"`python benchmarks/bench_host_add.py --write-results`. {machine.describe()} "
             "Ours (`runtime/transfer/mixed_add.py`, [Note: a mixed-precision add on the CPU]) against torch's own "
             "`fp32.add_(16-bit)`, alternating in one process, glibc's thresholds as a rank sets them; medians.", "",
             "| source | elements | torch add_ (G elements/s) | ours (G elements/s) | speed-up |", "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['numel']:,} | {r['torch add_ Gelem/s']} | {r['add_into Gelem/s']} | {r['speedup']}x |"
              for r in doc["add"]]
    lines += ["", f"The runtime's backward with gradient accumulation ({acc['model']}, batch {acc['batch']}, bf16, every "
              f"state in host memory, {acc['micro_batches']} micro-batches a step, {acc['steps']} steps): a backward "
              f"that adds into the shards took {acc['torch add_ accumulating backward s']} s with torch's add and "
              f"{acc['add_into accumulating backward s']} s with ours ({acc['speedup']}x).", "",
              "The fp16 loss scaler's overflow check over an fp32 gradient shard (`runtime/optim/loss_scaling.py`, "
              "[Note: an overflow check by sum]) against `torch.isfinite(grad).all()`:", "",
              "| elements | isfinite().all() (G elements/s) | ours, by sum (G elements/s) | speed-up |", "|---|---|---|---|"]
    lines += [f"| {r['numel']:,} | {r['isfinite().all() Gelem/s']} | {r['sum Gelem/s']} | {r['speedup']}x |"
              for r in doc["overflow_check"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
