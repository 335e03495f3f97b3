"""A probed GPU's compute model: the published-run fit of its generation, not its bare kernels.

[Note: a probed GPU takes its generation's fit]
`planner probe` on a CUDA machine times a block's matmuls at hd 8192 (the GPU's best) and a device
copy. Those are the rates of bare kernels at their best shapes; a training step runs smaller
matmuls, memory-bound kernels below copy speed and a fused attention kernel at its own rate. The
first run on a GPU showed how far apart they are (docs/notes/2026-11-26-first-gpu-run.md): the
probed spec (no matmul curve, no attention rate, so the fit planned `eager`) predicted a 1.2 B GPT's
all-on-GPU step at half the time the runtime took, and the generation's published-run fit
(planner/validation/fit.py: peak, matmul curve, attention rate and HBM fraction fitted on published
H100 rows and on this run, one row of its own source, planner/validation/own_runs.py) with the probe's
own links predicts it within a few percent, and so does the fit on the published rows alone (its
leave-one-source-out error, docs/validation.md).

So the probe keeps what it measures of the machine (GPU memory, host links, host memory, NVMe, CPU
Adam, collectives) and takes the compute model of the preset fitted for its GPU: the generation
whose GPU families the device's name contains (`GENERATIONS`), and within it the preset whose GPU
memory is closest to the device's (an H200 is not an H100: its datasheet HBM bandwidth, which the
fitted HBM fraction multiplies, is larger). A GPU of no fitted generation keeps the bare-kernel rates, with a
note that says they predict fast.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from planner.specs.catalog import hardware_presets
from planner.specs.units import GIB
from planner.validation.fit import GENERATIONS

FITTED_KEYS: tuple[str, ...] = ("gpu_peak_tflops", "gpu_nominal_tflops", "gpu_hbm_gb_per_s", "hbm_achievable_fraction",
                                "flash_attention_tflops", "fp8_matmul_tflops")
"""The document keys of the compute model a fit sets (planner/validation/fit.py `apply`), and the HBM
bandwidth its fraction multiplies; the matmul curve (`efficiency.matmul`) goes with them."""


class FittedCompute(NamedTuple):
    preset: str
    fields: dict[str, Any]
    """The preset's compute-model document fields (`FITTED_KEYS` it has, and `efficiency.matmul`)."""
    sources: dict[str, str]
    """Their provenance as the preset records it: the fitted ones name their corpus rows, the
    datasheet numbers the fit multiplies (nominal peak, HBM bandwidth) are `nominal`."""


def fitted_compute(gpu_name: str, gpu_memory_gib: float) -> FittedCompute | None:
    """The compute model of the preset fitted for a GPU called `gpu_name` (as CUDA names it, e.g.
    "NVIDIA H200") with `gpu_memory_gib`; None for a GPU of no fitted generation."""
    upper = gpu_name.upper()
    presets = hardware_presets()
    for families, names in GENERATIONS.values():
        if not any(family in upper for family in families):
            continue
        specs = [presets[name] for name in names if name in presets]
        if not specs:
            continue
        spec = min(specs, key=lambda s: abs(s.gpu_memory_bytes / GIB - gpu_memory_gib))
        doc = spec.to_dict()
        fields = {key: doc[key] for key in FITTED_KEYS if key in doc}
        if "matmul" in doc.get("efficiency", {}):
            fields["efficiency"] = {"matmul": doc["efficiency"]["matmul"]}
        recorded = doc.get("sources", {})
        return FittedCompute(spec.name, fields, {key: recorded.get(key, "nominal") for key in fields})
    return None
