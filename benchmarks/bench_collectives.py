"""Reduce-scatter on gloo: native vs the two fallbacks of runtime/transfer/collectives.py, side by side.

    python benchmarks/bench_collectives.py [--mib 1,16,64] [--repeats 11] [--write-results]

Two gloo ranks on this machine, one torch thread each; each method reduces the same flat fp32 buffer
(16 MiB: one Linear(1024, 4096) gradient), interleaved, median of `repeats`. Prints JSON;
`--write-results` also replaces the `collectives` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
METHODS = ("native", "pairwise", "allreduce")
HEADING = "## gloo reduce-scatter: native vs fallbacks (`benchmarks/bench_collectives.py`)"


def worker(rank: int, world: int, port: int, numel: int, repeats: int, out: str) -> None:
    from runtime.transfer.collectives import Comm, make_comm, reduce_scatter_flat

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group()
    default_method = make_comm().reduce_scatter_method
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    expected = None
    for _ in range(repeats):
        for method in METHODS:
            comm = Comm(dist.group.WORLD, group, world, rank, method)
            full = torch.full((numel,), float(rank + 1))
            dist.barrier()
            start = time.perf_counter()
            shard = reduce_scatter_flat(comm, full, {}).wait()
            times[method].append(time.perf_counter() - start)
            value = float(shard[0])
            expected = expected or value
            assert value == expected == sum(range(1, world + 1)), (method, value)
    if rank == 0:
        Path(out).write_text(json.dumps({"median_s": {m: statistics.median(t) for m, t in times.items()},
                                         "runtime_default": default_method}))
    dist.destroy_process_group()
    from runtime.process_exit import leave

    leave(0)  # [Note: a rank leaves with os._exit]


def measure(mib: float, repeats: int) -> dict:
    """One buffer size: two fresh ranks, every method `repeats` times interleaved."""
    numel = int(mib * 2**20 / 4) // 2 * 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path("/tmp") / f"bench_collectives_{os.getpid()}.json"
    mp.start_processes(worker, args=(2, port, numel, repeats, str(out)), nprocs=2, start_method="spawn")
    doc = json.loads(out.read_text())
    out.unlink()
    medians = doc["median_s"]
    return {"buffer_mib": mib, "median_s": medians, "fastest": min(medians, key=medians.get),
            "runtime_default": doc["runtime_default"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default="1,16,64", help="comma-separated buffer sizes in MiB")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    machine = results_md.measure_machine(torch=True)
    rows = [measure(float(mib), args.repeats) for mib in args.mib.split(",")]
    doc = {"benchmark": "gloo reduce-scatter, 2 ranks", "repeats": args.repeats, "sizes": rows,
           "machine": machine.finish().to_dict()}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        results_md.write_section("collectives", markdown(doc, args.mib, machine))


def markdown(doc: dict, mib: str, machine: results_md.MachineFacts) -> str:
    rows = doc["sizes"]
    default = rows[0]["runtime_default"]
    fastest = sorted({r["fastest"] for r in rows})
    lines = [HEADING, "",
             f"`python benchmarks/bench_collectives.py --mib {mib} --repeats {doc['repeats']} --write-results`: 2 gloo "
             "ranks on this machine, one torch thread each, the three methods interleaved, median time per "
             "reduce-scatter of one flat fp32 buffer (result checked on every call). " + machine.describe(), "",
             "| buffer | native (ms) | pairwise (ms) | allreduce + slice (ms) | fastest |", "|---|---|---|---|---|"]
    lines += [f"| {r['buffer_mib']:g} MiB | " + " | ".join(f"{r['median_s'][m] * 1e3:.2f}" for m in METHODS)
              + f" | {r['fastest']} |" for r in rows]
    lines += ["", f"The runtime's default on gloo (`runtime.transfer.collectives.make_comm`): `{default}`; fastest here: "
              + ", ".join(f"`{f}`" for f in fastest) + " (per size in the table)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
