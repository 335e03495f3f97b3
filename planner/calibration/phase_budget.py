"""A full-NVMe step's phases against the ideal disk time of the bytes each moves.

The schedule of docs/nvme.md ([Note: NVMe step schedule]) says which phase moves which bytes, as
multiples of P (parameter bytes on NVMe) and K (parameter bytes the backward reads); the measured
bytes of a step give P and K, and the bandwidths probed next to it the ideal time of each phase.
The NVMe benchmark reports this budget (benchmarks/bench_nvme_step.py).
"""

from __future__ import annotations

import statistics

PHASE_BYTES = {
    "after_backward": {"forward + backward": lambda p, k: (k, p), "optimizer": lambda p, k: (4 * p, 3 * p)},
    "in_backward": {"forward": lambda p, k: (p, 0), "backward + optimizer": lambda p, k: (k + 3 * p, 3 * p)},
}
"""Per optimizer step schedule: phase -> (bytes read, bytes written) from P and K (`phase_budget`)."""


def schedule_bytes(optimizer_step: str, read_bytes: int, write_bytes: int) -> tuple[float, float]:
    """P (parameter bytes on NVMe) and K from a step's measured bytes.

    After backward the step writes 4P (gradients, master, Adam's two states) and the optimizer reads
    4P (the gradient too); K is what the forward and the backward read together: at most P each, less
    what the forward kept gathered for the backward ([Note: the forward's tail is the backward's head])
    and the updated shards the overlapped step handed to the forward instead of the drive ([Note: the
    step overlaps the next forward]), which is why the two share a row. In backward the step writes 3P
    and reads 4P + K, K the backward's parameter reads (no gradient goes to NVMe: [Note: the optimizer
    step in backward])."""
    writes_per_p, reads_per_p, most_k = {"after_backward": (4, 4, 2), "in_backward": (3, 4, 1)}[optimizer_step]
    p = write_bytes / writes_per_p
    k = read_bytes - reads_per_p * p
    assert 0 <= k <= most_k * p, (optimizer_step, read_bytes, write_bytes)  # the schedule above
    return p, k


def phase_budget(runs: list[dict], system: str, optimizer_step: str) -> dict[str, dict[str, float]]:
    """Each phase of our step against the ideal disk time of its bytes at the adjacent probe's
    bandwidths (medians over the measured steps). Per parameter byte P on NVMe the schedule moves
    (docs/nvme.md, [Note: NVMe step schedule]): after backward, the forward and the backward read K
    <= 2P together and the backward writes P, and the optimizer reads 4P and writes 3P; in backward,
    the forward reads P, the backward reads K + 3P and writes 3P, and the optimizer phase is the tail
    of those writes, so the two are one row. P and K come from the step's measured bytes
    (`schedule_bytes`).

    `runs` are the NVMe benchmark's rounds (benchmarks/bench_nvme_step.py): per system, each measured
    step's (bytes read, bytes written), its phase times and its adjacent roofline probe; `system`
    names the one whose plan has `optimizer_step`."""
    out: dict[str, dict[str, float]] = {}
    for phase, moved in PHASE_BYTES[optimizer_step].items():
        measured, ideal = [], []
        for run in runs:
            for (read_bytes, write_bytes), phases, adj in zip(run["io_bytes"][system], run["phase_time_s"][system],
                                                               run["adjacent_rooflines"][system], strict=True):
                reads, writes = moved(*schedule_bytes(optimizer_step, read_bytes, write_bytes))
                measured.append(sum(phases[p] for p in phase.split(" + ")))
                ideal.append(reads / adj["read_bytes_per_s"] + writes / adj["write_bytes_per_s"])
        out[phase] = {"median_s": statistics.median(measured), "ideal_disk_s": statistics.median(ideal),
                      "median_ratio": statistics.median(m / i for m, i in zip(measured, ideal, strict=True))}
    return out
