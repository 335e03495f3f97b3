"""Reduce-scatter on gloo: native vs the two fallbacks of runtime/transfer/collectives.py, side by side.

    python benchmarks/bench_collectives.py [--mib 16] [--repeats 9]

Two gloo ranks on this machine; each method reduces the same flat fp32 buffer (the size of one
Linear(1024, 4096) gradient by default), interleaved, median of `repeats`. Prints JSON.
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
METHODS = ("native", "pairwise", "allreduce")


def worker(rank: int, world: int, port: int, numel: int, repeats: int, out: str) -> None:
    from runtime.transfer.collectives import Comm, reduce_scatter_flat

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group()
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
        Path(out).write_text(json.dumps({m: statistics.median(t) for m, t in times.items()}))
    dist.destroy_process_group()
    from runtime.process_exit import leave

    leave(0)  # [Note: a rank leaves with os._exit]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    numel = int(args.mib * 2**20 / 4) // 2 * 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path("/tmp") / f"bench_collectives_{os.getpid()}.json"
    mp.start_processes(worker, args=(2, port, numel, args.repeats, str(out)), nprocs=2, start_method="spawn")
    medians = json.loads(out.read_text())
    out.unlink()
    print(json.dumps({"benchmark": "gloo reduce-scatter, 2 ranks", "buffer_mib": args.mib, "repeats": args.repeats,
                      "median_s": medians, "fastest": min(medians, key=medians.get)}, indent=2))


if __name__ == "__main__":
    main()
