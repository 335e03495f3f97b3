"""A short soak (benchmarks/soak.py with few steps): after the first checkpoint, open file
descriptors, threads and swap-file sizes do not grow and RSS by at most 1 MiB (second half of the
samples vs the first)."""

from __future__ import annotations

import json
import subprocess
import sys

from reliability_support import ROOT, worker_env


def test_nothing_grows_over_a_short_nvme_soak_with_checkpoints() -> None:
    done = subprocess.run([sys.executable, "benchmarks/soak.py", "--steps", "100", "--sample-every", "5",
                           "--save-every", "10"], cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    doc = json.loads(done.stdout)
    grew = doc["growth_after_warmup"]
    assert doc["passed"] is True
    assert max(grew["open_fds"], grew["threads"], grew["swap_apparent_bytes"], grew["swap_allocated_bytes"]) <= 0
    assert grew["rss_bytes"] <= 1 << 20
    assert doc["loss_first_last"][1] < doc["loss_first_last"][0]
