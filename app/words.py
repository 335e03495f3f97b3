"""Library messages in the page's words: the library's one-line errors name the CLI's flags
(`--gpus must be at least 1`); the page has fields, so each flag becomes the field's name."""

from __future__ import annotations

import re

FIELD_WORDS = {
    "--gpus": "Number of GPUs",
    "--batch-per-gpu": "Batch per GPU",
    "--placement": "Placement",
    "--strategy": "Strategy",
    "--model-parallel": "Model-parallel degree",
    "--pipeline-parallel": "Pipeline-parallel degree",
    "--optimizer-step": "Optimizer step",
    "--precision": "Precision",
    "--seq": "Sequence length",
    "--layers": "Layers",
    "--hidden": "Hidden size",
    "--heads": "Attention heads",
    "--hardware": "Node preset",
    "--model": "Model",
    "--max-alloc-gib": "largest allocation (GiB)",
    "--tiling-factor": "tiling factor",
    "--recompute-interval": "recompute interval",
    "--prefetch-depth": "prefetch depth",
}
"""Flag -> the sidebar field that sets it (or, for a choice the page leaves to the search, its name)."""
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def in_words(message: str) -> str:
    """`message` with every CLI flag replaced by the page's name for it (unknown flags: spelled out)."""
    return _FLAG.sub(lambda m: FIELD_WORDS.get(m.group(0), m.group(0)[2:].replace("-", " ")), message)
