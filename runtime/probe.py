"""`planner probe`: measure this machine and write a hardware spec (`planner.specs.hardware.NodeSpec`).

Every number here is measured on the spot, side by side, with warm-up and the median of repeats:

- NVMe read/write bandwidth through the engine with O_DIRECT (page cache excluded), on a file in a
  private swap directory under `nvme_path`; the file is written once before timing so that reads
  hit real blocks (reads of never-written, fallocated extents return zeros without touching the drive).
- host memory bandwidth: a large tensor copy, counted as bytes read + written (STREAM "copy").
- CPU AdamW: torch's fused AdamW (docs/method.md §6: measure it before hand-writing SIMD).
- compute: the four linears of a transformer block (hd -> 3hd, hd -> hd, hd -> 4hd, 4hd -> hd,
  docs/method.md eq. 1), forward and backward, in every precision a plan may use (fp32, bf16,
  fp16: runtime/precision_probe.py); the spec states the fastest's rates and the others' ratios.
- the staged memcpy: pageable memory into a staging buffer, as the pinned staging pool copies;
- with CUDA: pinned (and, for comparison, pageable) host <-> device copies and device memory
  bandwidth; with more than one GPU,
  all-gather and reduce-scatter bus bandwidth over all of them (NCCL, one process per GPU).

On a machine without CUDA the CPU is the compute device: "GPU" fields describe the CPU and its
memory, and the spec says so.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planner.calibration.fitted_gpus import fitted_compute
from planner.specs.units import GB, GIB, MIB, TFLOP
from runtime.nvme import AlignedBuffer, EngineConfig, IOEngine, SwapDirectory, SwapStore
from runtime.precision_probe import PrecisionMeasurement, measure_precisions, torch_pass_timer
from runtime.precision_probe import median_time_s as _median_time_s
from runtime.process_exit import leave

Log = Callable[[str], None]



# -- NVMe ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NvmeBandwidth:
    read_bytes_per_s: float
    write_bytes_per_s: float
    direct: bool
    """False when the filesystem refused O_DIRECT: the numbers then include the page cache."""
    free_bytes: int
    test_bytes: int
    backend: str
    mixed_s: float = 0.0
    """Half the extents written while the other half are read, all in flight together."""
    read_write: str = "independent"
    """`shared` when reads and writes in flight together take about as long as one after the other
    ([Note: NVMe read/write sharing]); the simulator's `nvme_read_write`."""


def measure_nvme(
    nvme_path: str | os.PathLike[str], *, test_bytes: int = 1 * GIB, repeats: int = 3, config: EngineConfig | None = None
) -> NvmeBandwidth:
    """Write then read `test_bytes` (in 64 MiB requests, all submitted at once) `repeats` times."""
    chunk = min(test_bytes, 64 * MIB)
    num_chunks = max(1, test_bytes // chunk)
    engine = IOEngine(config or EngineConfig())
    with SwapDirectory(nvme_path, needed_bytes=num_chunks * chunk) as directory:
        free = os.statvfs(directory.path).f_bavail * os.statvfs(directory.path).f_frsize
        with SwapStore(directory, "probe", capacity_bytes=num_chunks * chunk, engine=engine) as store:
            buffer = AlignedBuffer(chunk)
            buffer.view[:] = os.urandom(chunk)  # incompressible, in case the drive compresses
            extents = [store.allocate(chunk) for _ in range(num_chunks)]

            def write() -> None:
                for handle in [store.write_async(extent, buffer.view) for extent in extents]:
                    handle.wait()

            def read() -> None:
                for handle in [store.read_async(extent, buffer.view) for extent in extents]:
                    handle.wait()

            def mixed() -> None:
                half = len(extents) // 2 or 1
                handles = [store.write_async(extent, buffer.view) for extent in extents[:half]]
                handles += [store.read_async(extent, scratch.view) for extent in extents[half:] or extents[:1]]
                for handle in handles:
                    handle.wait()

            write_s = _median_time_s(write, repeats=repeats)  # the warm-up pass lays the file out
            read_s = _median_time_s(read, repeats=repeats)
            scratch = AlignedBuffer(chunk)
            mixed_s = _median_time_s(mixed, repeats=repeats)
            direct = store.direct
            buffer.close()
            scratch.close()
    moved = num_chunks * chunk
    written = (num_chunks // 2 or 1) * chunk
    read_bytes = max(num_chunks - num_chunks // 2, 1) * chunk if num_chunks > 1 else chunk
    read_bps, write_bps = moved / read_s, moved / write_s
    return NvmeBandwidth(read_bps, write_bps, direct, free, moved, engine.backend, mixed_s,
                         read_write_sharing(read_bytes / read_bps, written / write_bps, mixed_s))


def read_write_sharing(read_alone_s: float, write_alone_s: float, mixed_s: float) -> str:
    """[Note: NVMe read/write sharing] If a device serves reads and writes from independent budgets,
    a mix of both takes as long as the longer of the two alone; if from one budget, as long as both
    one after the other. The probe times the mix and picks the model whose prediction is closer (a
    virtio disk measured 'shared': the mix took the serial time, benchmarks/RESULTS.md)."""
    independent_s, shared_s = max(read_alone_s, write_alone_s), read_alone_s + write_alone_s
    return "shared" if abs(mixed_s - shared_s) < abs(mixed_s - independent_s) else "independent"


# -- host ------------------------------------------------------------------------------------------
CACHE_MULTIPLE = 4
"""[Note: host measurements beyond the cache] The host's working sets are at least this many times its
largest CPU cache. On a GPU host with a server CPU a working set
sized for a small cache partly ran from cache: fused AdamW over 16 Mi parameters moved its 28 bytes
per parameter faster than a copy of the same size, and predicted the runtime's step over 1.2 B
parameters less than half as long as it took (docs/notes/2026-11-26-first-gpu-run.md). Server CPUs carry 100-300 MB of last-level cache, so
the probe sizes both measurements from it; on a machine with a 32 MB cache they stay as they were."""


SYSFS_CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = SYSFS_CPU0_CACHES) -> int:
    """The largest CPU cache the kernel reports for CPU 0 (`index*/size`, e.g. "32768K"), 0 where it
    reports none."""
    sizes = []
    for path in caches.glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def host_working_set_bytes(cache_bytes: int | None = None) -> int:
    """What the host measurements stream through: 256 MiB, or `CACHE_MULTIPLE` x the largest cache."""
    return max(256 * MIB, CACHE_MULTIPLE * (last_level_cache_bytes() if cache_bytes is None else cache_bytes))


def measure_host_memory_bytes_per_s(nbytes: int | None = None, repeats: int = 5) -> float:
    nbytes = nbytes or host_working_set_bytes()
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    seconds = _median_time_s(lambda: target.copy_(source), repeats=repeats)
    return 2 * nbytes / seconds  # bytes read + bytes written


ADAM_STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, gradient and two moments: what fused AdamW streams through per parameter."""


def cpu_adam_probe_params(working_set_bytes: int | None = None) -> int:
    """Parameters the CPU Adam measurement updates: enough to fill the host working set (16 Mi at
    its 256 MiB floor)."""
    return (working_set_bytes or host_working_set_bytes()) // ADAM_STATE_BYTES_PER_PARAM


def measure_cpu_adam_params_per_s(num_params: int | None = None, repeats: int = 5) -> float:
    """torch fused AdamW on fp32 params (one tensor, so no per-tensor overhead), over a working set
    beyond the CPU's caches ([Note: host measurements beyond the cache])."""
    num_params = num_params or cpu_adam_probe_params()
    param = torch.nn.Parameter(torch.zeros(num_params))
    param.grad = torch.randn(num_params, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([param], lr=1e-3, fused=True)
    seconds = _median_time_s(optimizer.step, repeats=repeats, warmup=2)
    return num_params / seconds


def measure_staged_memcpy_bytes_per_s(nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second the launching thread copies from pageable memory into a staging buffer, as
    the pinned staging pool does (runtime/transfer/pinned_pool.py: `staged.copy_(piece)`), over a
    working set beyond the CPU's caches: the first leg of a `host_pinning: staged` copy
    (planner/cost/host_link.py). The buffer is page-locked where CUDA can lock it, page-aligned else."""
    nbytes = nbytes or host_working_set_bytes()
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    if torch.cuda.is_available():
        staging = torch.empty_like(source, pin_memory=True)
    else:
        buffer = AlignedBuffer(nbytes)
        staging = torch.frombuffer(buffer.view, dtype=torch.float32, count=nbytes // 4)
    seconds = _median_time_s(lambda: staging.copy_(source), repeats=repeats)
    return nbytes / seconds  # bytes copied (each read once and written once)


# -- compute ---------------------------------------------------------------------------------------
COMPUTE_HIDDEN = {"cpu": 1024, "cuda": 8192}
COMPUTE_TOKENS = {"cpu": 512, "cuda": 8192}
"""The block the matmul rates are measured at, per device type (runtime/precision_probe.py): at a
GPU's its GEMMs run near their plateau; a CPU's plateau comes at far smaller matmuls."""
DTYPE_OF_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The torch dtype (its name) a plan's `precision` computes in."""


ATTENTION_HEADS, ATTENTION_HEAD_DIM = 16, 64
"""The attention the probe times on a CPU device: the heads of `measure_block_matmul`'s block (hd 1024
= 16 heads of 64)."""
ATTENTION_SEQ_LENS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
"""Sequence lengths it is timed at ([Note: the fused kernel's rate by sequence length] in
planner/cost/kernels.py), each over `ATTENTION_TOKENS` tokens, so each takes about as many key blocks.
Every doubling up to 512: below a key block the kernel's rate grows about in proportion to the
sequence, which the curve, flat below its first point and log-linear between points, would
otherwise miss by up to 1.6x (measurements: docs/notes/2026-11-26-calibration-sensitivities.md)."""
ATTENTION_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class AttentionThroughput:
    flops_per_s: float
    """The best rate over the sequence lengths (`flash_attention_tflops`)."""
    by_seq_len: dict[int, float]
    """Sequence length -> rate; over the best they are the spec's `efficiency.attention` curve."""

    def efficiency_points(self) -> list[dict[str, float]]:
        return [{"seq_len": seq, "efficiency": round(rate / self.flops_per_s, 4)} for seq, rate in self.by_seq_len.items()]


def measure_causal_attention(device: torch.device, dtype: torch.dtype, *, repeats: int = 3) -> AttentionThroughput:
    """The runtime's attention core (`F.scaled_dot_product_attention(is_causal=True)`, runtime/gpt.py),
    forward and backward, at each of `ATTENTION_SEQ_LENS`, in flops per second as the planner counts a
    fused kernel's: half the seq x seq square forward, 2.5 x that backward (planner/cost/kernels.py [Note:
    attention kernels]).

    [Note: the CPU's fused attention] On a CPU torch dispatches that call to its flash kernel
    (`_scaled_dot_product_flash_attention_for_cpu` and its backward): block-wise, scores never
    stored, recomputed in backward, exactly the planner's `attention: flash`. A spec without this
    rate plans `eager` (seq^2 scores stored, softmaxed by memory-bound kernels, the whole square
    multiplied), which is not what the runtime runs there. Its rate rises with the sequence: it
    computes the key block on the diagonal whole (up to 512 keys), so at 128-512 tokens a causal
    call costs what a non-causal one does, and at 2048 about two thirds of it."""
    import torch.nn.functional as F

    h, d = ATTENTION_HEADS, ATTENTION_HEAD_DIM
    rates = {}
    for s in ATTENTION_SEQ_LENS:
        b = max(1, ATTENTION_TOKENS // s)
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=device, dtype=dtype)

        def run(q=q, k=k, v=v, grad=grad) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        forward_flops = 4 * b * s * s * h * d / 2
        rates[s] = forward_flops * (1 + 2.5) / _median_time_s(run, repeats=repeats, warmup=1)
    return AttentionThroughput(max(rates.values()), rates)


def measure_block_kernels(device: torch.device, dtype: torch.dtype, *, hidden: int = 1024, tokens: int = 1024,
                          repeats: int = 3) -> float:
    """A GPT block's memory-bound kernels (runtime/gpt.py: two LayerNorms, GELU over the 4 hd hidden,
    two residual adds), forward and backward, in bytes per second as the planner counts their bytes
    (planner/cost/kernels.py [Note: memory-bound kernels]: norms 2 + 3 hd e, residual adds 3 + 3 hd e,
    GELU 2 + 3 ffn e per token, forward + backward).

    [Note: the CPU's memory-bound kernels] On a CPU these run far below copy bandwidth (torch's
    LayerNorm and GELU backward in bf16 are compute loops, not streams), so the copy bandwidth
    times them many-fold too fast. Timed here at a block's shape, right after the matmuls and the
    attention, their rate is the third of the three the CPU's training runs at, and calibration
    fits one factor for all three (planner/calibration/calibrate.py [Note: one factor for the CPU's kernels])."""
    import torch.nn.functional as F

    ffn = 4 * hidden
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    h = torch.randn(tokens, ffn, device=device, dtype=dtype, requires_grad=True)
    norm = torch.nn.LayerNorm(hidden, device=device, dtype=dtype)
    dx, dh = torch.randn_like(x), torch.randn_like(h)

    def run() -> None:
        for _ in range(2):
            norm(x).backward(dx)
            torch.add(x.detach(), dx)  # a residual add forward, and its backward's sum of two branches
            torch.add(dx, dx)
        F.gelu(h).backward(dh)

    e = x.element_size()
    nbytes = tokens * (2 * (2 + 3) * hidden * e + 2 * (3 + 3) * hidden * e + (2 + 3) * ffn * e)
    return nbytes / _median_time_s(run, repeats=repeats, warmup=1)


# -- CUDA ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CudaLinks:
    host_to_device_bytes_per_s: float
    device_to_host_bytes_per_s: float
    device_memory_bytes_per_s: float


def measure_cuda_links(device: torch.device, nbytes: int = 512 * MIB, repeats: int = 5) -> CudaLinks:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    gpu_copy = torch.empty_like(gpu)

    def timed(copy: Callable[[], object]) -> float:
        def run() -> None:
            copy()
            torch.cuda.synchronize(device)

        return _median_time_s(run, repeats=repeats)

    h2d = nbytes / timed(lambda: gpu.copy_(host, non_blocking=True))
    d2h = nbytes / timed(lambda: host.copy_(gpu, non_blocking=True))
    hbm = 2 * nbytes / timed(lambda: gpu_copy.copy_(gpu))
    return CudaLinks(h2d, d2h, hbm)


@dataclass(frozen=True, slots=True)
class HostCopyPaths:
    """Host<->device copy rates from pinned and from pageable host memory, one GPU alone."""

    pinned_h2d_bytes_per_s: float
    pinned_d2h_bytes_per_s: float
    pageable_h2d_bytes_per_s: float
    pageable_d2h_bytes_per_s: float


def measure_host_copy_paths(device: torch.device, nbytes: int = 256 * MIB, repeats: int = 5) -> HostCopyPaths:
    """The same copies from page-locked and from pageable host memory: what `host_pinning: shards`
    gets (the link's rate) and what copying pageable shards directly would (the driver stages them)."""
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def rate(copy: Callable[[], object]) -> float:
        def run() -> None:
            copy()
            torch.cuda.synchronize(device)

        return nbytes / _median_time_s(run, repeats=repeats)

    out = []
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        out += [rate(lambda host=host: gpu.copy_(host, non_blocking=True)),
                rate(lambda host=host: host.copy_(gpu, non_blocking=True))]
    return HostCopyPaths(*out)


@dataclass(frozen=True, slots=True)
class CollectiveBandwidth:
    """Bus bandwidth per rank (nccl-tests convention: (n-1)/n of the full tensor per rank)."""

    all_gather_bytes_per_s: float
    reduce_scatter_bytes_per_s: float
    world_size: int
    backend: str


def _collective_worker(rank: int, world_size: int, backend: str, port: int, nbytes: int, queue) -> None:
    import torch.distributed as dist

    from runtime.transfer.collectives import all_gather_into, reduce_scatter_into

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    numel = nbytes // 4 // world_size * world_size
    full = torch.ones(numel, device=device)
    shard = torch.empty(numel // world_size, device=device)

    def timed(op: Callable[[], object]) -> float:
        def run() -> None:
            op()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()

        return _median_time_s(run, repeats=5)

    gather_s = timed(lambda: all_gather_into(full, shard))
    scatter_s = timed(lambda: reduce_scatter_into(shard, full))
    if rank == 0:
        bus = (world_size - 1) / world_size * numel * 4
        queue.put((bus / gather_s, bus / scatter_s))
    dist.destroy_process_group()
    leave(0)  # [Note: a rank leaves with os._exit]


def measure_collectives(world_size: int, backend: str, nbytes: int = 256 * MIB) -> CollectiveBandwidth:
    """Spawn `world_size` local ranks and time all-gather / reduce-scatter of `nbytes` tensors."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(
        _collective_worker, args=(world_size, backend, port, nbytes, queue), nprocs=world_size, start_method="spawn"
    )
    gather, scatter = queue.get()
    return CollectiveBandwidth(gather, scatter, world_size, backend)


# -- the spec --------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(slots=True)
class _Findings:
    """What `probe_node` measured so far: spec fields, where each came from, and the notes."""

    doc: dict
    sources: dict[str, str]
    notes: list[str]

    def measured(self, **fields: float) -> None:
        """Spec fields this probe measured (their source says so)."""
        self.doc.update(fields)
        self.sources.update(dict.fromkeys(fields, "measured"))

    def document(self, name: str, description: str) -> dict:
        """The hardware document of what was found (`NodeSpec.from_dict` accepts it)."""
        return {"name": name, "description": description, **self.doc, "sources": self.sources,
                "notes": " ".join(self.notes)}


@dataclass(slots=True)
class Stages:
    """Says which stage of how many the probe is at: `k/N what` through `log`."""

    total: int
    log: Log
    done: int = 0

    def start(self, what: str) -> None:
        self.done += 1
        self.log(f"{self.done}/{self.total} {what}")


def probe_stages(on_cuda: bool, num_gpus: int = 0) -> int:
    """How many stages `probe_node` logs: NVMe, host memory, CPU Adam, the staged memcpy, the matmuls,
    then the CPU's attention and memory-bound kernels, or the GPU's links, its pinned vs pageable
    copies and (with several GPUs) collectives."""
    return 5 + (2 + (num_gpus > 1) if on_cuda else 2)


def probe_node(
    *,
    nvme_path: str | os.PathLike[str],
    nvme_test_bytes: int = 1 * GIB,
    name: str | None = None,
    engine_config: EngineConfig | None = None,
    log: Log = lambda message: None,
) -> tuple[dict, str]:
    """Measure this machine; returns a hardware document that `NodeSpec.from_dict` accepts, and the
    plan precision (`fp32`, `bf16`, `fp16`) its compute rates are stated in (`compute_precision`)."""
    host = socket.gethostname()
    cores = os.cpu_count() or 1
    memory = _memory_bytes()
    on_cuda = torch.cuda.is_available()
    stages = Stages(probe_stages(on_cuda, torch.cuda.device_count() if on_cuda else 0), log)
    found, host_memory = _probe_host(nvme_path, nvme_test_bytes, engine_config, memory=memory, stages=stages)
    if on_cuda:
        compute, description = _probe_cuda_device(found, host=host, cores=cores, stages=stages)
    else:
        compute, description = _probe_cpu_device(found, host=host, cores=cores, memory=memory,
                                                 host_memory=host_memory, stages=stages)
    found.notes.append(_compute_note(compute))
    if on_cuda:  # over the bare peak just recorded (its note keeps it)
        _take_generation_fit(found, torch.cuda.get_device_properties(0))
    return found.document(name or f"probed-{host}", description), found.doc["compute_precision"]


def _record_compute(found: _Findings, compute: PrecisionMeasurement, stated: str, *, backward: bool) -> None:
    """The spec's compute rates: `stated`'s matmul rate (and, with `backward`, its backward's), and
    every precision's measured rates ([Note: a plan's precision prices its compute] in
    planner/specs/hardware.py)."""
    rates = compute.rates[stated]
    found.measured(gpu_peak_tflops=rates.matmul_flops_per_s / TFLOP)
    if backward:
        found.measured(backward_matmul_tflops=rates.backward_matmul_flops_per_s / TFLOP)
    found.doc["compute_precision"] = stated
    found.doc["precision_rates"] = {p: compute.rates[p].to_dict() for p in sorted(compute.rates)}
    found.sources.update(compute_precision="measured", precision_rates="measured")


def _probe_host(nvme_path: str | os.PathLike[str], nvme_test_bytes: int, engine_config: EngineConfig | None, *,
                memory: int, stages: Stages) -> tuple[_Findings, float]:
    """The host's side, whatever the compute device: NVMe, host memory bandwidth and CPU AdamW; also
    returns the host memory bandwidth (bytes/s)."""
    notes: list[str] = []
    stages.start(f"NVMe: writing and reading {nvme_test_bytes / GIB:g} GiB with O_DIRECT under {nvme_path}")
    nvme = measure_nvme(nvme_path, test_bytes=nvme_test_bytes, config=engine_config)
    nvme_source = "measured" if nvme.direct else "estimate"
    notes.append(
        f"NVMe: {nvme.test_bytes / GIB:g} GiB in 64 MiB requests through the {nvme.backend} engine under "
        f"{Path(nvme_path).resolve()} (free {nvme.free_bytes / GIB:.1f} GiB), median of 3; half written while half is "
        f"read took {nvme.mixed_s:.3f} s: reads and writes {nvme.read_write}."
        + ("" if nvme.direct else " The filesystem refused O_DIRECT: these are page-cache numbers, not the drive's.")
    )
    cache = last_level_cache_bytes()
    working_set = host_working_set_bytes(cache)
    adam_params = cpu_adam_probe_params(working_set)
    stages.start("host memory bandwidth")
    host_memory = measure_host_memory_bytes_per_s(working_set)
    stages.start("CPU AdamW (torch fused)")
    adam = measure_cpu_adam_params_per_s(adam_params)
    stages.start("staged memcpy (pageable -> staging buffer)")
    memcpy = measure_staged_memcpy_bytes_per_s(working_set)
    notes.append(
        f"Host memory: {working_set / MIB:g} MiB tensor copy, bytes read + written. CPU AdamW: "
        f"torch {torch.__version__} AdamW(fused=True), {adam_params / (1 << 20):g} Mi fp32 params, "
        f"{torch.get_num_threads()} threads (working sets at least {CACHE_MULTIPLE}x the largest CPU cache, "
        f"{cache / MIB:g} MiB)."
    )
    doc: dict = {
        "cpu_memory_gib": memory / GIB,
        "nvme_capacity_gib": nvme.free_bytes / GIB,
        "host_memory_gb_per_s": host_memory / GB,
        "nvme_read_gb_per_s": nvme.read_bytes_per_s / GB,
        "nvme_write_gb_per_s": nvme.write_bytes_per_s / GB,
        "nvme_read_write": nvme.read_write,
        "cpu_adam_gparams_per_s": adam / 1e9,
        "host_memcpy_gb_per_s": memcpy / GB,
    }
    sources = dict(
        cpu_memory_gib="measured",
        nvme_capacity_gib="measured",
        host_memory_gb_per_s="measured",
        nvme_read_gb_per_s=nvme_source,
        nvme_write_gb_per_s=nvme_source,
        cpu_adam_gparams_per_s="measured",
        host_memcpy_gb_per_s="measured",
    )
    notes.append(_host_copy_note(memcpy, working_set))
    return _Findings(doc, sources, notes), host_memory


def _probe_cuda_device(found: _Findings, *, host: str, cores: int,
                       stages: Stages) -> tuple[PrecisionMeasurement, str]:
    """GPU 0's compute and links, and the collectives over every GPU of the node; returns the compute
    measurement and the spec's description."""
    device = torch.device("cuda", 0)
    properties = torch.cuda.get_device_properties(device)
    num_gpus = torch.cuda.device_count()
    stages.start(f"{properties.name}: a block's matmuls in fp32, bf16 and fp16")
    compute = measure_precisions(torch_pass_timer(device), hidden=COMPUTE_HIDDEN["cuda"],
                                 rows=COMPUTE_TOKENS["cuda"], screen=False)
    # bf16 states the rates: the generation fit taken over them is fitted on bf16 runs.
    _record_compute(found, compute, "bf16", backward=False)
    stages.start(f"{properties.name}: host links")
    links = measure_cuda_links(device)
    found.measured(
        num_gpus_per_node=num_gpus,
        gpu_memory_gib=properties.total_memory / GIB,
        gpu_hbm_gb_per_s=links.device_memory_bytes_per_s / GB,
        host_to_gpu_gb_per_s=links.host_to_device_bytes_per_s / GB,
        gpu_to_host_gb_per_s=links.device_to_host_bytes_per_s / GB,
    )
    description = f"{num_gpus} x {properties.name} on {host} ({cpu_model()}, {cores} cores), measured by planner probe"
    found.notes.append(
        "GPU: pinned 512 MiB host<->device copies (one GPU alone); device memory copy counts bytes read + written."
    )
    stages.start("host copies: pinned vs pageable")
    found.notes.append(_copy_paths_note(measure_host_copy_paths(device)))
    _probe_nccl(found, num_gpus, stages=stages)
    return compute, description


def _host_copy_note(memcpy_bytes_per_s: float, working_set: int) -> str:
    where = ("into a page-locked buffer" if torch.cuda.is_available() else
             "into a page-aligned buffer (no CUDA: nothing to page-lock, and nothing crosses a link)")
    return (f"Staged memcpy: {memcpy_bytes_per_s / GB:.2f} GB/s, {working_set / MIB:g} MiB copied from pageable "
            f"memory {where} by torch's copy on the calling thread, as the staging pool copies (host_memcpy_gb_per_s).")


def _copy_paths_note(paths: HostCopyPaths) -> str:
    return (f"Host copies, one GPU, 256 MiB: pinned h2d {paths.pinned_h2d_bytes_per_s / GB:.1f} GB/s, d2h "
            f"{paths.pinned_d2h_bytes_per_s / GB:.1f} GB/s; pageable h2d {paths.pageable_h2d_bytes_per_s / GB:.1f} GB/s, "
            f"d2h {paths.pageable_d2h_bytes_per_s / GB:.1f} GB/s (host_pinning: shards copies at the pinned rates).")


PAGEABLE_SKIPPED = ("Host copies pinned vs pageable: skipped: no CUDA device, so the host is the device and no copy "
                    "crosses a link (host_pinning does not apply).")
"""The probe's note where it cannot measure host<->device copies, and why."""


def _take_generation_fit(found: _Findings, properties: Any) -> None:
    """The compute model of the preset fitted for this GPU's generation over the bare-kernel rates just
    measured (planner/calibration/fitted_gpus.py [Note: a probed GPU takes its generation's fit]); the measured
    links stay. A GPU of no fitted generation keeps the bare rates, and its notes say so."""
    fitted = fitted_compute(properties.name, properties.total_memory / GIB)
    if fitted is None:
        found.notes.append(
            f"Compute model: no published-run fit covers {properties.name}, so the spec holds bare-kernel rates "
            "(the block matmul's best, a device copy), which predict a training step fast (2.0x on an H200).")
        return
    bare = {key: found.doc[key] for key in ("gpu_peak_tflops", "gpu_hbm_gb_per_s") if key in found.doc}
    found.doc.update(fitted.fields)
    found.sources.update(fitted.sources)
    found.notes.append(
        f"Compute model: preset {fitted.preset}'s, fitted on published runs of its generation (peak, matmul curve, "
        f"fused attention rate, HBM fraction of the datasheet bandwidth); the bare kernels measured here, "
        + ", ".join(f"{key} {value:.4g}" for key, value in bare.items())
        + ", predict a training step fast (planner/calibration/fitted_gpus.py).")


def _probe_nccl(found: _Findings, num_gpus: int, *, stages: Stages) -> None:
    """All-gather and reduce-scatter bus bandwidth over the node's GPUs (skipped with one)."""
    if num_gpus <= 1:
        found.notes.append("Collectives: skipped, one GPU (nothing to all-gather across).")
        return
    stages.start(f"all-gather / reduce-scatter over {num_gpus} GPUs (NCCL)")
    collectives = measure_collectives(num_gpus, "nccl")
    found.doc["gpu_gpu_intra_node_gb_per_s"] = (
        min(collectives.all_gather_bytes_per_s, collectives.reduce_scatter_bytes_per_s) / GB
    )
    found.sources["gpu_gpu_intra_node_gb_per_s"] = "measured"
    found.notes.append(
        f"Collectives: NCCL bus bandwidth over {num_gpus} GPUs, all-gather "
        f"{collectives.all_gather_bytes_per_s / GB:.1f} GB/s, reduce-scatter "
        f"{collectives.reduce_scatter_bytes_per_s / GB:.1f} GB/s; the spec keeps the lower."
    )


def _probe_cpu_device(found: _Findings, *, host: str, cores: int, memory: int, host_memory: float,
                      stages: Stages) -> tuple[PrecisionMeasurement, str]:
    """Without CUDA the CPU is the compute device: its matmuls, and host memory standing in for the
    device's; returns the compute measurement and the spec's description. The attention and the
    memory-bound kernels are timed in the fastest precision, the one the spec states its rates in."""
    stages.start("CPU as the compute device: a block's matmuls in fp32, bf16 and fp16")
    cpu = torch.device("cpu")
    compute = measure_precisions(torch_pass_timer(cpu), hidden=COMPUTE_HIDDEN["cpu"], rows=COMPUTE_TOKENS["cpu"],
                                 screen_pass=torch_pass_timer(cpu, threads=1))
    _record_compute(found, compute, compute.fastest, backward=True)
    dtype = getattr(torch, DTYPE_OF_PRECISION[compute.fastest])
    stages.start(f"CPU as the compute device: causal attention in {compute.fastest}")
    attention = measure_causal_attention(torch.device("cpu"), dtype, repeats=2)
    stages.start(f"CPU as the compute device: a block's memory-bound kernels in {compute.fastest}")
    kernels = measure_block_kernels(torch.device("cpu"), dtype)
    found.doc.update(num_gpus_per_node=1, host_is_device=True)
    found.doc.setdefault("efficiency", {})["attention"] = attention.efficiency_points()
    found.sources["efficiency"] = "measured"
    found.measured(
        flash_attention_tflops=attention.flops_per_s / TFLOP,
        hbm_achievable_fraction=min(1.0, kernels / host_memory),
        gpu_memory_gib=memory / GIB,
        gpu_hbm_gb_per_s=host_memory / GB,
        host_to_gpu_gb_per_s=host_memory / GB,
        gpu_to_host_gb_per_s=host_memory / GB,
    )
    description = (
        f"{host}: {cpu_model()}, {cores} cores, {memory / GIB:.0f} GiB RAM, no CUDA; the CPU is the compute "
        "device (measured by planner probe)"
    )
    found.notes.append(
        "No CUDA: the CPU is the compute device, so the 'gpu' fields describe the CPU and the same host RAM "
        "(gpu_memory_gib and cpu_memory_gib are one pool, not two), and host<->device 'transfers' are memory "
        "copies (host memory bandwidth). Collectives: skipped, one rank."
    )
    found.notes.append(
        f"Attention: torch's fused causal kernel on the CPU ([Note: the CPU's fused attention] in runtime/probe.py), "
        f"{ATTENTION_HEADS} heads of {ATTENTION_HEAD_DIM}, {ATTENTION_TOKENS} tokens, forward and backward, "
        f"{compute.fastest}, TFLOPS by sequence length: "
        + ", ".join(f"{seq} {rate / TFLOP:.4g}" for seq, rate in attention.by_seq_len.items())
        + f" (flash_attention_tflops the best, efficiency.attention each over it). Memory-bound kernels "
        f"([Note: the CPU's memory-bound kernels]): two LayerNorms, GELU and two residual adds of a hd 1024 block, 1024 "
        f"tokens, forward and backward, {kernels / GB:.4g} GB/s: hbm_achievable_fraction is that over the copy bandwidth."
    )
    found.notes.append(PAGEABLE_SKIPPED)
    return compute, description


def _compute_note(compute: PrecisionMeasurement) -> str:
    by_precision = ", ".join(
        f"{p} {r.matmul_flops_per_s / TFLOP:.4g} forward / {r.backward_matmul_flops_per_s / TFLOP:.4g} backward"
        + (" (from the screen)" if p in compute.screened_only else "") for p, r in sorted(compute.rates.items()))
    return (
        f"Compute: a transformer block's four linears (hd {compute.hidden}, {compute.rows} tokens, F.linear forward "
        f"and backward) in TFLOPS: {by_precision} (runtime/precision_probe.py); precision_rates holds them, and "
        f"{compute.fastest} trains fastest."
    )
