"""The optimizer's host work per step with the fp32 master as the parameter shard (`host_param_shard:
master`) against a 16-bit parameter shard of its own (`compute_copy`, the default).

planner/cost/host_work.py [Note: the resident step's cast]: with the copy, each update of a unit casts
its fp32 master into the bf16 shard (`HostStore.write_host`) on the optimizer's thread, after torch's
fused AdamW; with the master as the shard the update is in place and nothing is cast on the host. Two
sharded models of the reference MLP (benchmarks/bench_runtime.py) at hidden 2048 and FFN 8192, bf16,
every state in host memory, one per mode in one process; each step's `optimizer.step()` (AdamW over
every unit, and the casts) is timed, the two modes alternating step by step so that machine noise hits
both alike; with the copy, the casts alone are timed too (the store's `write_host`, wrapped). The
model is far larger than any CPU cache (per parameter the step reads and writes the master, momentum,
variance and reads the gradient), so the step is bound by memory bandwidth.

    python benchmarks/bench_host_master.py [--blocks 2] [--steps 7] [--write-results]

Prints one JSON document (seconds, medians over the steps after one warm-up, and the median of the
per-step ratios, each pairing the two modes' adjacent steps); `--write-results` also
replaces the `host_master` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import results_md
import torch
from bench_runtime import LR, build_model, plan_doc  # benchmarks/ is on sys.path

import runtime
from runtime.host_malloc import keep_freed_memory_mapped
from runtime.transfer.host_store import HostStore

HIDDEN, FFN, BATCH, TOKENS = 2048, 8192, 1, 16
MODES = ("compute_copy", "master")


class CastTimer:
    """Seconds spent in `HostStore.write_host` (the cast of an updated master into the 16-bit shard)
    while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = HostStore.write_host

    def __enter__(self) -> CastTimer:
        original = self._original

        def timed(store: HostStore, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(store, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        HostStore.write_host = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        HostStore.write_host = self._original  # type: ignore[method-assign]


def sharded(mode: str, blocks: int) -> tuple[Any, Any]:
    plan = plan_doc("cpu")
    plan.update(precision="bf16", host_param_shard=mode)
    plan["model"].update(num_layers=blocks, hidden_size=HIDDEN, ffn_hidden_size=FFN, seq_len=TOKENS)
    torch.manual_seed(0)
    model = runtime.shard(build_model(HIDDEN, FFN, blocks), plan)
    return model, runtime.AdamW(model, lr=LR, weight_decay=0.0)


def bench(blocks: int, steps: int) -> dict:
    systems = {mode: sharded(mode, blocks) for mode in MODES}
    torch.manual_seed(1)
    x, y = (torch.randn(BATCH, TOKENS, HIDDEN, dtype=torch.bfloat16) for _ in range(2))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    casts: list[float] = []
    for step in range(steps + 1):
        for mode, (model, opt) in systems.items():
            model(x, y).backward()
            with CastTimer() as cast:
                start = time.perf_counter()
                opt.step()
                elapsed = time.perf_counter() - start
            opt.zero_grad()
            if step:  # the first step allocates Adam's states
                times[mode].append(elapsed)
                if mode == "compute_copy":
                    casts.append(cast.seconds)
    params = sum(u.layout.shard_numel for u in runtime.state_of(systems["master"][0]).units)
    median = {mode: statistics.median(v) for mode, v in times.items()}
    paired = [m / c for m, c in zip(times["master"], times["compute_copy"], strict=True)]
    return {"model": f"{blocks} x (LayerNorm, Linear({HIDDEN}, {FFN}), Linear({FFN}, {HIDDEN})), bf16, every state in "
                     "host memory", "parameters": params, "steps": steps,
            **{f"{mode} step s": round(v, 4) for mode, v in median.items()},
            **{f"{mode} fastest step s": round(min(v), 4) for mode, v in times.items()},
            "compute_copy cast s": round(statistics.median(casts), 4),
            "master / compute_copy": round(statistics.median(paired), 3),
            "master / compute_copy per step": [round(r, 3) for r in paired],
            "cast GB/s": round(params * 6 / statistics.median(casts) / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    keep_freed_memory_mapped()
    machine = results_md.measure_machine(torch=True)
    doc = bench(args.blocks, args.steps)
    doc["machine"] = machine.finish().to_dict()
    print(json.dumps(doc, indent=1))
    if args.write_results:
        results_md.write_section("host_master", markdown(doc, machine))


def markdown(doc: dict, machine: results_md.MachineFacts) -> str:
    return "\n".join([
        "## The fp32 master as the host parameter shard (`benchmarks/bench_host_master.py`)", "",
        "`python benchmarks/bench_host_master.py --write-results`.",
        machine.describe(), "",
        f"{doc['model']}: {doc['parameters'] / 1e6:,.1f} M parameters, median of {doc['steps']} optimizer steps "
        "(after one warm-up), the two modes alternating in one process.", "",
        "| host_param_shard | optimizer.step() s, median | fastest | of which the cast s, median |",
        "|---|---|---|---|",
        f"| compute_copy | {doc['compute_copy step s']} | {doc['compute_copy fastest step s']} | "
        f"{doc['compute_copy cast s']} ({doc['cast GB/s']} GB/s: 4 B read, 2 B written per parameter) |",
        f"| master | {doc['master step s']} | {doc['master fastest step s']} | none |", "",
        f"master / compute_copy, the median of the per-step ratios: **{doc['master / compute_copy']}** of the "
        f"optimizer's time per step (each step: {', '.join(map(str, doc['master / compute_copy per step']))}; "
        "planner/cost/host_work.py [Note: the resident step's cast]).",
    ])


if __name__ == "__main__":
    main()
