"""The one writer of benchmarks/RESULTS.md, and the one place that measures the machine a section ran on.

`write_section("sim_speed", body)` replaces what stands between `<!-- sim_speed:begin -->` and
`<!-- sim_speed:end -->`, or appends the section when the file has none yet; every other section
stays as it is. Each section is written by exactly one script (tests/test_results_md.py).

`measure_machine()` at the start of a run and `MachineFacts.finish()` at its end record what a
section may say about the machine: CPU model and count, memory, kernel, Python, load average before
and after, and on request torch, package and tool versions and the disk under a directory. A script
states no fact about the machine it did not get from here (tests/test_results_md.py). Standard
library only: the GPU kit carries this file to a machine without the project's dependencies.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = "# Benchmark results\n"
GIB = 1024**3


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    section = f"{begin}\n{body.strip(chr(10))}\n{end}"
    text = path.read_text() if path.exists() else HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text and text.isdigit() else None


@dataclass(frozen=True)
class DiskFacts:
    """The file system and block device holding `directory`; None where the system does not say."""

    directory: str
    filesystem: str | None
    source: str | None
    driver: str | None
    model: str | None
    max_segments: int | None
    max_sectors_kib: int | None

    @classmethod
    def of(cls, directory: str | Path) -> DiskFacts:
        """`directory`, or its nearest existing parent when the run has yet to create it."""
        path = Path(directory).resolve()
        while not path.exists():
            path = path.parent
        directory = str(path)
        try:
            found = subprocess.run(["findmnt", "-no", "FSTYPE,SOURCE", "--target", directory],
                                   capture_output=True, text=True, timeout=30).stdout.split()
        except (OSError, subprocess.TimeoutExpired):  # no util-linux: the file system goes unnamed
            found = []
        device = os.stat(directory).st_dev
        block = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
        block = block.resolve() if block.exists() else None
        if block is not None and not (block / "queue").exists():  # a partition: the queue is its disk's
            block = block.parent
        queue = block / "queue" if block else Path("/nonexistent")
        driver = block / "device" / "driver" if block else None
        return cls(directory=directory, filesystem=found[0] if found else None,
                   source=found[1] if len(found) > 1 else None,
                   driver=driver.resolve().name if driver is not None and driver.exists() else None,
                   model=_read(block / "device" / "model") if block else None,
                   max_segments=_int(queue / "max_segments"), max_sectors_kib=_int(queue / "max_sectors_kb"))

    def describe(self) -> str:
        what = " ".join(x for x in (self.filesystem or "unknown file system", "on", self.source or "?") if x)
        device = ", ".join(x for x in (self.driver, self.model) if x)
        limits = (f"at most {self.max_segments} segments and {self.max_sectors_kib} KiB per request"
                  if self.max_segments and self.max_sectors_kib else "")
        detail = "; ".join(x for x in (device, limits) if x)
        return f"`{self.directory}`: {what}" + (f" ({detail})" if detail else "")


@dataclass
class MachineFacts:
    """The machine as measured at the start of a run (and, after `finish`, at its end)."""

    host: str
    arch: str
    cpu_model: str
    cpus: int
    avx512: bool | None
    memory_gib: float
    kernel: str
    python: str
    started_utc: str
    load_before: tuple[float, float, float]
    transparent_hugepages: str | None
    reserved_hugepages: int | None
    torch: str | None = None
    torch_threads: int | None = None
    gpu: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    disk: DiskFacts | None = None
    load_after: tuple[float, float, float] | None = None
    wall_s: float | None = None
    _started: float = field(default_factory=time.perf_counter, repr=False, compare=False)

    def finish(self) -> MachineFacts:
        """Record the load average and the wall time at the end of the run; returns self."""
        self.load_after = os.getloadavg()
        self.wall_s = time.perf_counter() - self._started
        return self

    def load(self) -> str:
        """The 1-minute load average before (and after) the run against the CPU count."""
        after = f" / {self.load_after[0]:.2f} after" if self.load_after else ""
        return f"load average {self.load_before[0]:.2f} before{after} on {self.cpus} CPUs"

    def describe(self) -> str:
        """One sentence for a RESULTS section: every fact measured, nothing assumed."""
        isa = "" if self.avx512 is None else f" ({'AVX-512' if self.avx512 else 'no AVX-512'})"
        parts = [f"{self.host}: {self.cpu_model}{isa}, {self.cpus} CPUs, {self.memory_gib:.1f} GiB memory, "
                 f"{self.arch}, Linux {self.kernel}, Python {self.python}"]
        if self.torch:
            gpu = f"CUDA device {self.gpu}" if self.gpu else "no CUDA device"
            threads = f"{self.torch_threads} thread{'' if self.torch_threads == 1 else 's'}"
            parts.append(f"torch {self.torch} ({threads}), {gpu}")
        parts += [version if version.startswith(name) else f"{name} {version}" for name, version in self.versions.items()]
        if self.disk:
            parts.append(f"disk {self.disk.describe()}")
        wall = f", {self.wall_s:.0f} s" if self.wall_s is not None else ""
        return f"Machine: {'; '.join(parts)}; {self.load()}{wall}; measured {self.started_utc}."

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc.pop("_started")
        return doc

    @classmethod
    def from_dict(cls, doc: dict) -> MachineFacts:
        disk = DiskFacts(**doc["disk"]) if doc.get("disk") else None
        return cls(**{**doc, "disk": disk})


def _cpu() -> tuple[str, bool | None]:
    info = _read("/proc/cpuinfo") or ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown CPU")
    flags = next((line for line in info.splitlines() if line.startswith("flags")), None)
    return model, (" avx512f" in flags) if flags is not None else None


def _memory_gib() -> float:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB


def _version(name: str) -> str:
    """A Python distribution's version, else the first line of `name --version` (a tool such as fio)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        out = subprocess.run([name, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "not installed"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "unknown"


def measure_machine(*, torch: bool = False, versions: tuple[str, ...] = (),
                    disk: str | Path | None = None) -> MachineFacts:
    """The machine now, at the start of a run. `torch` adds torch's version, threads and CUDA device
    (it imports torch); `versions` Python distributions or command-line tools by name; `disk` the file
    system and block device under that directory."""
    model, avx512 = _cpu()
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    facts = MachineFacts(
        host=platform.node(), arch=platform.machine(), cpu_model=model, cpus=os.cpu_count() or 1, avx512=avx512,
        memory_gib=_memory_gib(), kernel=platform.release(), python=platform.python_version(),
        started_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_before=os.getloadavg(),
        transparent_hugepages=thp.split("[", 1)[1].split("]", 1)[0] if thp and "[" in thp else thp,
        reserved_hugepages=_int(Path("/proc/sys/vm/nr_hugepages")),
        versions={name: _version(name) for name in versions},
        disk=DiskFacts.of(disk) if disk is not None else None)
    if torch:
        import torch as torch_module

        facts.torch, facts.torch_threads = torch_module.__version__, torch_module.get_num_threads()
        facts.gpu = torch_module.cuda.get_device_name(0) if torch_module.cuda.is_available() else None
    return facts


def load_now() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages now (for a script that samples it between its parts)."""
    return os.getloadavg()


def spread(samples: list[float]) -> float:
    """The largest over the smallest sample of a series of repeats (1.0: all equal)."""
    return max(samples) / min(samples) if samples and min(samples) > 0 else float("nan")


if __name__ == "__main__":  # what a section would say about this machine
    print(measure_machine(disk=sys.argv[1] if len(sys.argv) > 1 else None).describe())
