"""`--hardware local`: this machine's spec, probed once and kept in the user cache until the machine
changes.

The probe (`runtime.probe.probe_node`, without reference runs) measures the machine as it is; the
cache file holds its document beside the fingerprint of the machine it measured (`Fingerprint`: CPU
model, cores, memory, GPUs, torch version). A machine whose fingerprint differs from the cached one
is probed again and the file replaced: a new torch build, another GPU or a resized VM runs at other
rates. Delete the file to probe the same machine again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.specs.errors import PlannerError
from planner.specs.units import GIB, MIB

CACHE_FILE = "local-hardware.json"
LOCAL_NAME = "local"
LOCAL_NVME_TEST_BYTES = 256 * MIB
"""NVMe bytes the local probe writes and reads per pass: four 64 MiB requests in flight, a quarter of
`planner probe`'s default, to keep the probe within a minute on a slow disk."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a probe's numbers depend on: a machine with another fingerprint is probed again."""

    cpu_model: str
    cores: int
    memory_gib: int
    gpus: tuple[str, ...]
    torch_version: str

    def describe(self) -> str:
        gpus = ", ".join(self.gpus) if self.gpus else "no GPU"
        return f"{self.cpu_model}, {self.cores} cores, {self.memory_gib} GiB, {gpus}; torch {self.torch_version}"

    def to_dict(self) -> dict:
        return {**asdict(self), "gpus": list(self.gpus)}

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def this_fingerprint() -> Fingerprint:
    import torch

    from runtime.probe import cpu_model

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    return Fingerprint(cpu_model(), os.cpu_count() or 1, round(memory / GIB), gpus, torch.__version__)


@dataclass(frozen=True, slots=True)
class LocalHardware:
    document: dict
    """The hardware document (`NodeSpec.from_dict` reads it)."""
    fingerprint: Fingerprint
    path: Path
    probed: bool
    """True when this call probed the machine, False when it read the cache."""
    probed_at: str
    """When the document was measured (UTC, minutes)."""

    def line(self) -> str:
        """The line the CLI prints when it read the cache (before a probe it says so itself)."""
        return (f"hardware local: this machine's probe of {self.probed_at} from {self.path} (probed again when the "
                "CPU, cores, memory, GPUs or torch change; delete the file to probe now)")


Probe = Callable[[], dict]
"""Measures this machine into a hardware document."""


def default_probe(log: Callable[[str], None] = lambda message: None) -> Probe:
    def probe() -> dict:
        from runtime.probe import probe_node

        doc, _ = probe_node(nvme_path=tempfile.gettempdir(), nvme_test_bytes=LOCAL_NVME_TEST_BYTES, name=LOCAL_NAME,
                            log=log)
        return doc

    return probe


def local_hardware(cache_dir: Path, *, fingerprint: Fingerprint | None = None, probe: Probe | None = None,
                   clock: Callable[[], float] = time.time, refresh: bool = False) -> LocalHardware:
    """This machine's hardware document: the cached one if it was measured on a machine of the same
    fingerprint (and not `refresh`), else a fresh probe (`probe`, default `default_probe()`), cached."""
    fingerprint = fingerprint or this_fingerprint()
    path = cache_dir / CACHE_FILE
    cached = None if refresh else _read(path)
    if cached is not None and cached.get("fingerprint") == fingerprint.to_dict():
        return LocalHardware(cached["hardware"], fingerprint, path, probed=False, probed_at=cached["probed_at"])
    document = (probe or default_probe())()
    probed_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(clock()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"fingerprint": fingerprint.to_dict(), "probed_at": probed_at, "hardware": document},
                          indent=2) + "\n"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(text)
        temporary.replace(path)
    except OSError as error:
        raise PlannerError(f"cannot cache the local hardware in {path}: {error.strerror or error}; "
                           "set XDG_CACHE_HOME to a writable directory") from None
    return LocalHardware(document, fingerprint, path, probed=True, probed_at=probed_at)


def _read(path: Path) -> dict | None:
    """The cache file's contents, or None when there is none or it is not one (probed again then)."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or not {"fingerprint", "probed_at", "hardware"} <= set(cached):
        return None
    return cached
