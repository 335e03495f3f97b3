"""Measure host memory during NVMe-placement training steps (runtime.memory_probe).

Prints one JSON line: the plan's host-memory budget, the runtime ledger's host peak, the anonymous
RSS growth during the steps and the bytes of model states on NVMe, planned with the hardware spec
data/hardware/cpu-dev-2core.json. Run it with glibc's mmap threshold fixed, as the tests do, so that freed
buffers leave RSS:

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/nvme_memory_probe.py \
        NVME_PATH NUM_LAYERS HIDDEN STEPS [RECOMPUTE_INTERVAL [OPTIMIZER_STEP]]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runtime.memory_probe import nvme_step_host_memory

HARDWARE = Path(__file__).resolve().parents[1] / "data" / "hardware" / "cpu-dev-2core.json"


def main() -> None:
    nvme_path, layers, hidden, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    recompute_interval = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    optimizer_step = sys.argv[6] if len(sys.argv) > 6 else "after_backward"
    hardware = json.loads(HARDWARE.read_text())
    print(json.dumps(nvme_step_host_memory(hardware, nvme_path, layers, hidden, steps, recompute_interval,
                                           optimizer_step)))


if __name__ == "__main__":
    main()
