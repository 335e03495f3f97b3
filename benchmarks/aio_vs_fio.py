"""Tierwise's async I/O engine vs fio: sequential direct read and write bandwidth, side by side.

Both move the same file (written once beforehand, so reads hit real blocks) with O_DIRECT, the
same block size and the same queue depth, fio through its io_uring engine, in its default and in
its batched-submission mode (see [Note: fio's two submission modes]). Runs alternate
(fio then engine, engine then fio, ...) so that background load and the drive's drift hit both
alike; the ratios are of the medians. Target: read_ratio and write_ratio >= 0.95.

Usage: python benchmarks/aio_vs_fio.py [--json] [--dir DIR] [--size-gib G] [--repeats N]
       [--block-kib K] [--queue-depth Q] [--backend io_uring|threads|python] [--sweep]
`--sweep` measures a grid of block sizes and queue depths (how the defaults were chosen).
With --json it prints one JSON object whose `read_ratio` / `write_ratio` are engine / best fio.
Writes the section between the aio_vs_fio markers of benchmarks/RESULTS.md unless --no-results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.nvme import AlignedBuffer, EngineConfig, IOEngine, SwapDirectory, open_io_file  # noqa: E402

DEFAULTS = EngineConfig()
MIB = 1024**2
GIB = 1024**3
GB = 1e9


# [Note: fio's two submission modes]
# By default fio submits one I/O per io_uring_enter as completions arrive; the engine submits every
# free slot in one call. fio therefore also runs with batched submission
# (--iodepth_batch_submit=QD --iodepth_batch_complete_max=QD), and the reported ratios are
# against the faster of the two fio medians. Device requests per GiB (from the device's sysfs
# stat) show how the kernel split or merged each tool's blocks; see [Note: huge-page buffers].
FIO_MODES = {"fio": [], "fio_batched": ["--iodepth_batch_submit={depth}", "--iodepth_batch_complete_max={depth}"]}


def device_stat_path(path: Path) -> Path | None:
    """/sys/dev/block/MAJ:MIN/stat of the device holding `path` (None if sysfs lacks it)."""
    device = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat")
    return stat if stat.exists() else None


def device_requests(stat: Path | None, mode: str) -> int:
    """Requests the device has completed so far (field 1 reads, field 5 writes of the stat file)."""
    if stat is None:
        return 0
    fields = stat.read_text().split()
    return int(fields[0] if mode == "read" else fields[4])


def fio_bandwidth(path: Path, *, tool: str, mode: str, size: int, block: int, depth: int) -> float:
    command = [
        "fio", "--name=tierwise", f"--filename={path}", f"--rw={mode}", f"--bs={block}", f"--iodepth={depth}",
        "--direct=1", "--ioengine=io_uring", f"--size={size}", "--numjobs=1", "--output-format=json",
    ] + [option.format(depth=depth) for option in FIO_MODES[tool]]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    job = json.loads(result.stdout)["jobs"][0]
    return float(job["read" if mode == "read" else "write"]["bw_bytes"])


def engine_bandwidth(engine: IOEngine, path: Path, buffer: AlignedBuffer, *, mode: str, size: int) -> float:
    chunk = buffer.nbytes
    with open_io_file(path) as file:
        assert file.direct, f"{path} refused O_DIRECT; the comparison needs direct I/O"
        submit = engine.read_async if mode == "read" else engine.write_async
        start = time.perf_counter()
        handles = [submit(file, offset=offset, buffer=buffer.view) for offset in range(0, size, chunk)]
        for handle in handles:
            handle.wait()
        return size / (time.perf_counter() - start)


def compare(path: Path, *, size: int, block: int, depth: int, threads: int, backend: str, repeats: int) -> dict:
    engine = IOEngine(EngineConfig(block_size_bytes=block, queue_depth=depth, num_threads=threads, backend=backend))
    buffer = AlignedBuffer(min(size, 256 * MIB))
    buffer.view[:] = os.urandom(buffer.nbytes)
    tools = ["engine", *FIO_MODES]

    def run(tool: str, mode: str) -> float:
        if tool == "engine":
            return engine_bandwidth(engine, path, buffer, mode=mode, size=size)
        return fio_bandwidth(path, tool=tool, mode=mode, size=size, block=block, depth=depth)

    stat = device_stat_path(path)
    samples: dict[str, list[float]] = {f"{tool}_{mode}": [] for mode in ("read", "write") for tool in tools}
    requests: dict[str, list[int]] = {key: [] for key in samples}
    for mode in ("write", "read"):  # writing first lays the file out, so reads hit real blocks
        for tool in tools:
            run(tool, mode)  # warm-up, not counted
        for round_index in range(repeats):
            # Rotate who goes first: the virtual disk's bandwidth drifts within seconds.
            shift = round_index % len(tools)
            for tool in tools[shift:] + tools[:shift]:
                before = device_requests(stat, mode)
                samples[f"{tool}_{mode}"].append(run(tool, mode))
                requests[f"{tool}_{mode}"].append(device_requests(stat, mode) - before)
    buffer.close()
    medians = {key: statistics.median(values) for key, values in samples.items()}
    ratios = {}
    for mode in ("read", "write"):
        best_fio = max(medians[f"{tool}_{mode}"] for tool in FIO_MODES)
        ratios[f"{mode}_ratio"] = round(medians[f"engine_{mode}"] / best_fio, 3)
        for tool in FIO_MODES:
            ratios[f"{mode}_ratio_vs_{tool}"] = round(medians[f"engine_{mode}"] / medians[f"{tool}_{mode}"], 3)
    return {
        "block_size_bytes": block,
        "queue_depth": depth,
        "num_threads": threads,
        "backend": engine.backend,
        **ratios,
        "median_gb_per_s": {key: round(value / GB, 3) for key, value in medians.items()},
        # Device requests per GiB moved (includes any other process's I/O on the device meanwhile).
        "median_device_requests_per_gib": {
            key: round(statistics.median(values) * GIB / size) for key, values in requests.items()
        },
        "samples_gb_per_s": {key: [round(v / GB, 3) for v in values] for key, values in samples.items()},
    }


def _sweep_summary(sweep: list[dict]) -> str:
    """Lowest queue depth per block size at which both ratios met the 0.95 target in the sweep."""
    if not sweep:
        return ""
    parts = []
    for block in sorted({row["block_size_bytes"] for row in sweep}):
        depths = sorted(
            row["queue_depth"]
            for row in sweep
            if row["block_size_bytes"] == block and min(row["read_ratio"], row["write_ratio"]) >= 0.95
        )
        parts.append(f"{block // 1024} KiB: {f'depth {depths[0]}' if depths else 'none'}")
    return " Lowest queue depth meeting 0.95 both ways in the sweep below: " + ", ".join(parts) + "."


def _spread_sentence(result: dict, sweep: list[dict]) -> str:
    """How far the repeats of one tool and direction lie apart, from the samples themselves."""
    samples = result["samples_gb_per_s"]
    widest = max(samples, key=lambda key: results_md.spread(samples[key]))
    worst = results_md.spread(samples[widest])
    steady = min(results_md.spread(v) for v in samples.values())
    sweep_note = (" The sweep's figures are medians of 3 samples each, so at such a spread they rank settings only "
                  "roughly." if sweep else "")
    return (f"Spread of the {result['repeats']} samples of each tool and direction (fastest / slowest): "
            f"{steady:.2f}x to {worst:.2f}x, widest `{widest}` ({min(samples[widest]):.3f} to "
            f"{max(samples[widest]):.3f} GB/s); the ratios above are of the medians." + sweep_note)


def _why_sentence(machine: results_md.MachineFacts) -> str:
    """Why the engine's requests can be fewer than fio's, with this device's and kernel's own limits."""
    disk = machine.disk
    segments = f"this device allows {disk.max_segments} per request" if disk and disk.max_segments else \
        "the device's segment limit is not in sysfs"
    largest = (f"up to max_sectors_kb ({disk.max_sectors_kib} KiB here: {GIB // (disk.max_sectors_kib * 1024)} requests "
               "per GiB)") if disk and disk.max_sectors_kib else "up to the device's largest request"
    reserved = machine.reserved_hugepages
    hugetlb = ("which needs reserved huge pages: none are reserved here (vm.nr_hugepages = 0)" if reserved == 0 else
               f"which needs reserved huge pages (vm.nr_hugepages = {reserved} here; fio does not use them by default)")
    return ("Why the engine can beat fio: its buffers are advised onto transparent huge pages (THP mode here: "
            f"`{machine.transparent_hugepages}`), so a 1 MiB block can be one DMA segment and adjacent blocks merge "
            f"into requests of {largest}, while fio's buffers are on 4 KiB pages, where a 1 MiB block needs up to 256 "
            f"segments ({segments}) unless the pages happen to be physically contiguous, so its I/O is split more "
            "and merged less ([Note: huge-page buffers] in runtime/nvme/buffers.py). Request counts are the device's "
            "totals while each run lasted, other processes' I/O included (writes especially: the file system's "
            f"journal). fio could use huge pages only through hugetlbfs (`--iomem=mmaphuge`), {hugetlb}.")


def write_results(result: dict, sweep: list[dict], machine: results_md.MachineFacts) -> None:
    m = result["median_gb_per_s"]
    r = result["median_device_requests_per_gib"]
    lines = [
        "## Async I/O engine vs fio (`python benchmarks/aio_vs_fio.py`)",
        "",
        f"`python benchmarks/aio_vs_fio.py --dir {result['directory']} --size-gib {result['file_gib']:g} --repeats {result['repeats']}"
        f"{' --sweep' if sweep else ''}`. {machine.describe()}",
        "",
        f"File: {result['file_gib']:g} GiB, O_DIRECT, sequential, block {result['block_size_bytes'] // 1024} KiB, "
        f"queue depth {result['queue_depth']}; fio uses `--ioengine=io_uring`, the engine its "
        f"`{result['backend']}` backend. The order of the three rotates every round; medians of "
        f"{result['repeats']}. Defaults (`EngineConfig`): {DEFAULTS.block_size_bytes // 1024} KiB blocks (the "
        f"plan's default `nvme_block_bytes`), queue depth {DEFAULTS.queue_depth}, {DEFAULTS.num_threads} threads "
        "for the thread-pool backends." + _sweep_summary(sweep),
        "",
        "| | fio GB/s | fio batched GB/s | engine GB/s | engine / best fio | device requests per GiB (fio / batched / engine) |",
        "|---|---|---|---|---|---|",
        f"| read | {m['fio_read']:.3f} | {m['fio_batched_read']:.3f} | {m['engine_read']:.3f} | "
        f"**{result['read_ratio']:.3f}** | {r['fio_read']} / {r['fio_batched_read']} / {r['engine_read']} |",
        f"| write | {m['fio_write']:.3f} | {m['fio_batched_write']:.3f} | {m['engine_write']:.3f} | "
        f"**{result['write_ratio']:.3f}** | {r['fio_write']} / {r['fio_batched_write']} / {r['engine_write']} |",
        "",
        _spread_sentence(result, sweep),
        "",
        "fio batched: `--iodepth_batch_submit=QD --iodepth_batch_complete_max=QD` (plain fio submits one I/O "
        "per call); the ratio is against the faster fio. " + _why_sentence(machine),
        "",
        f"Samples (GB/s): `{json.dumps(result['samples_gb_per_s'])}`",
    ]
    if sweep:
        lines += ["", "Tuning sweep (same file and settings for all; medians of 3; GB/s):", "",
                  "| block KiB | queue depth | fio read | fio batched read | engine read | ratio | fio write | fio batched write | engine write | ratio |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in sweep:
            s = row["median_gb_per_s"]
            lines.append(
                f"| {row['block_size_bytes'] // 1024} | {row['queue_depth']} | {s['fio_read']:.3f} | "
                f"{s['fio_batched_read']:.3f} | {s['engine_read']:.3f} | {row['read_ratio']:.3f} | "
                f"{s['fio_write']:.3f} | {s['fio_batched_write']:.3f} | {s['engine_write']:.3f} | {row['write_ratio']:.3f} |"
            )
    results_md.write_section("aio_vs_fio", "\n".join(lines))


def main() -> None:
    defaults = DEFAULTS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the drive to measure")
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block-kib", type=int, default=defaults.block_size_bytes // 1024)
    parser.add_argument("--queue-depth", type=int, default=defaults.queue_depth)
    parser.add_argument("--threads", type=int, default=defaults.num_threads)
    parser.add_argument("--backend", default="io_uring", choices=["io_uring", "threads", "python"])
    parser.add_argument("--sweep", action="store_true", help="also measure a grid of block sizes and depths")
    parser.add_argument("--no-results", action="store_true", help="do not touch benchmarks/RESULTS.md")
    args = parser.parse_args()
    if shutil.which("fio") is None:
        sys.exit("fio is not installed: apt-get install -y fio")

    size = int(args.size_gib * GIB) // MIB * MIB
    machine = results_md.measure_machine(versions=("fio",), disk=args.dir)
    with SwapDirectory(args.dir, needed_bytes=size) as directory:
        path = directory.path / "bench.dat"
        with open_io_file(path, create=True) as file:
            os.posix_fallocate(file.direct_fd, 0, size)
        sweep = []
        if args.sweep:
            for block_kib in (256, 1024, 4096):
                for depth in (4, 16, 64, 128):
                    row = compare(path, size=size, block=block_kib * 1024, depth=depth, threads=args.threads,
                                  backend=args.backend, repeats=3)  # fmt: skip
                    print(json.dumps(row), file=sys.stderr)
                    sweep.append(row)
        result = compare(path, size=size, block=args.block_kib * 1024, depth=args.queue_depth,
                         threads=args.threads, backend=args.backend, repeats=args.repeats)  # fmt: skip
    result.update(
        machine=machine.finish().to_dict(), file_gib=size / GIB, directory=str(Path(args.dir).resolve()),
        repeats=args.repeats, target_ratio=0.95,
    )  # fmt: skip
    if not args.no_results:
        write_results(result, sweep, machine)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
