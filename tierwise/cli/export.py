"""`planner export`: a training checkpoint of a Hugging Face architecture as a `from_pretrained` folder
(runtime/ckpt/export.py; docs/export.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tierwise.cli import options as o
from tierwise.cli.machine import require_runtime


def export(
    checkpoint_dir: Annotated[Path, typer.Argument(help="a run's --checkpoint-dir", click_type=o.PATH)],
    out: Annotated[Path, typer.Option("--out", help="the folder to write (must not exist, or be empty)", click_type=o.PATH)],
    step: Annotated[int | None, typer.Option("--step", help="export this step's training checkpoint (default: the newest complete one)")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="fp32, bf16 or fp16 (default: the config's dtype, else fp32)")] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="largest safetensors file, e.g. 5GB or 500MiB; "
                                                                         "above it the weights are split with an index")] = "5GB",
    as_json: o.JsonOpt = False,
) -> None:
    """Write a training checkpoint's weights as a Hugging Face folder (config.json + safetensors) that
    from_pretrained loads."""
    require_runtime("export")
    from runtime.ckpt.export import export as run_export
    from runtime.ckpt.export import parse_size

    result = run_export(checkpoint_dir, out, step=step, dtype=dtype, max_shard_bytes=parse_size(max_shard_size))
    if as_json:
        o.print_json({"out": str(result.out), "step": result.step, "dtype": result.dtype, "files": result.files,
                      "tensors": result.tensors, "total_bytes": result.total_bytes})
        return
    print(f"exported step {result.step} of {checkpoint_dir} to {result.out}: {result.tensors} tensors, "
          f"{result.total_bytes / 1e6:.1f} MB {result.dtype} in {len(result.files)} file(s)")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
