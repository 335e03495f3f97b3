"""Option types and parsers every `planner` verb shares: one definition per option, so a flag means
the same thing, takes the same values and says the same help on every verb that has it.

"Checkpoint" means a training checkpoint only: the run's saved state on disk (`planner run
--save-every`, `--checkpoint-dir`, `--keep-checkpoints`, `--resume`). Activation recompute has its
own words: `--recompute-interval` (blocks per recompute segment) and the placement's
`recompute_inputs` tier (where each segment's input is kept); `OLD_FLAGS` still reads a flag's old
spelling.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand
from typer.models import TyperPath

from planner.specs.errors import PlannerError

# -- the model: every verb that takes one takes all of these --------------------------------------
ModelArg = Annotated[str | None, typer.Argument(help="size shorthand (1T, 175B, 13b), preset name or model JSON file")]
LayersOpt = Annotated[int | None, typer.Option("--layers", help="transformer blocks")]
HiddenOpt = Annotated[int | None, typer.Option("--hidden", help="hidden size")]
HeadsOpt = Annotated[int | None, typer.Option("--heads", help="attention heads")]
SeqOpt = Annotated[int | None, typer.Option("--seq", help="sequence length")]
VocabOpt = Annotated[int | None, typer.Option("--vocab", help="vocabulary size (0 ignores embeddings)")]

# -- the cluster ---------------------------------------------------------------------------------
GpusOpt = Annotated[int, typer.Option("--gpus", help="number of GPUs")]
HardwareOpt = Annotated[str | None, typer.Option(
    "--hardware", help="hardware preset, JSON file, or 'local' (this machine, probed once and cached; default dgx-h100)")]
MaxAllocOpt = Annotated[float | None, typer.Option("--max-alloc-gib", help="largest contiguous GPU allocation")]

# -- the plan's choices (fit searches the ones not given; memory and simulate take them as given) --
StrategyOpt = Annotated[str | None, typer.Option(
    "--strategy", help="pin a strategy: dp, zero2, zero-offload, zero3, zero-inf-cpu, zero-inf-nvme, 3d (tensor x "
                       "pipeline x data parallel, ZeRO-1)")]
PlacementOpt = Annotated[str | None, typer.Option(
    "--placement", help="pin tiers, e.g. params=nvme,optimizer_states=nvme (recompute_inputs: where each "
                        "recompute segment's input is kept)")]
BatchOpt = Annotated[float | None, typer.Option("--batch-per-gpu", help="pin global batch / GPUs")]
RecomputeIntervalOpt = Annotated[int | None, typer.Option(
    "--recompute-interval",
    help="pin blocks per recompute segment: each keeps its input and runs its blocks' forward again in backward "
         "(0: no block recomputed)")]
TilingOpt = Annotated[int | None, typer.Option("--tiling-factor", help="pin the tiling factor")]
PrefetchOpt = Annotated[int | None, typer.Option("--prefetch-depth", help="pin the prefetch depth")]
ModelParallelOpt = Annotated[str | None, typer.Option(
    "--model-parallel", help="tensor-parallel degree within a node, or 'auto' to search it")]
PipelineParallelOpt = Annotated[str | None, typer.Option(
    "--pipeline-parallel", help="pipeline stages (1F1B), or 'auto' to search them (default: auto for --strategy 3d, "
                                "else 1)")]
MicroBatchesOpt = Annotated[int | None, typer.Option(
    "--micro-batches", help="micro-batches per optimizer step (gradient accumulation; a pipeline's m; default 4 per "
                            "stage when pipelined, else 1)")]
PrecisionOpt = Annotated[str | None, typer.Option(
    "--precision", help="bf16, fp16 or fp32 (default bf16, or fp32 where the hardware emulates bf16)")]
OptimizerStepOpt = Annotated[str | None, typer.Option(
    "--optimizer-step", help="after_backward (default: the paper's step) or in_backward (each unit updated as soon as "
                             "its gradient is final; no gradient accumulation or clipping)")]
SearchedOptimizerStepOpt = Annotated[str | None, typer.Option(
    "--optimizer-step", help="pin after_backward (the paper's step) or in_backward (each unit updated as soon as its "
                             "gradient is final); default: the faster of those the training allows")]
ClipGradNormOpt = Annotated[bool, typer.Option(
    "--clip-grad-norm", help="the training clips gradients by their global norm, which needs every gradient before "
                             "any update: only the after-backward optimizer step is considered")]

# -- paths ---------------------------------------------------------------------------------------


class CliPath(TyperPath):
    """typer's path type (`<path>` in the help), refusing a NUL byte, which no path can hold, as a
    usage error: the type's `os.stat` would raise ValueError for it, not the OSError it answers."""

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201
        if "\x00" in str(value):
            self.fail(f"{str(value)!r} holds a NUL byte, which no path can", param, ctx)
        return super().convert(value, param, ctx)


PATH = CliPath()
"""The type of every path option and argument (`click_type=o.PATH`)."""

# -- output and stores -----------------------------------------------------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="print the JSON document instead of tables")]
StoreOpt = Annotated[Path | None, typer.Option("--store", help="run-history SQLite file (default: user cache dir)",
                                                  click_type=PATH)]

AUTO = "auto"

OLD_FLAGS = {"--checkpoint-interval": "--recompute-interval"}
"""Old spelling -> new, for command lines written before the rename (planner/specs/plan.py [Note: old
spellings]); the help shows only the new one."""


class RenamedFlags(TyperCommand):
    """A verb that reads the old spellings of OLD_FLAGS as the new ones."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, new_flag_spellings(args))


def new_flag_spellings(args: list[str]) -> list[str]:
    """`args` with every OLD_FLAGS flag (`--old V` or `--old=V`) spelt anew; nothing after `--`."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        flag, eq, value = arg.partition("=")
        out.append(OLD_FLAGS.get(flag, flag) + eq + value)
    return out


def model_parallel(text: str | None) -> int | None:
    """`--model-parallel`: a positive whole number, or None for `auto` (search the degree) and for
    not given (the caller's default)."""
    return None if text is None else _degree(text, "--model-parallel")


def degree_given(text: str | None, flag: str) -> int | str | None:
    """A parallel degree option as `planner.search.pins.parallel_degrees` takes it: a whole number,
    `auto`, or None (not given)."""
    if text is None or is_auto(text):
        return None if text is None else AUTO
    return _degree(text, flag)


def _degree(text: str, flag: str) -> int | None:
    """A parallel degree option's value: a positive whole number, or None for `auto`."""
    if text.strip().lower() == AUTO:
        return None
    try:
        value = int(text)
    except ValueError:
        raise PlannerError(f"{flag} must be a whole number or 'auto', got {text!r}") from None
    if value < 1:
        raise PlannerError(f"{flag} must be at least 1, got {value}")
    return value


def is_auto(text: str | None) -> bool:
    return text is not None and text.strip().lower() == AUTO


def model(name, layers, hidden, heads, seq, vocab):  # noqa: ANN001, ANN201
    """The MODEL argument resolved; what reading it assumed or ignored (a Hugging Face config's
    unknown keys and unstated defaults) goes to stderr, so `--json` output stays one document."""
    from planner.specs.catalog import model_notes, resolve_model

    spec = resolve_model(name, layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    for line in model_notes(name, seq_given=seq is not None):
        sys.stderr.write(line + "\n")
    return spec


LOCAL = "local"
"""`--hardware local`: this machine (runtime/local_hardware.py)."""


def node(hardware: str | None, max_alloc_gib: float | None = None):  # noqa: ANN201
    from planner.specs.catalog import resolve_hardware

    spec = local_node() if hardware == LOCAL else resolve_hardware(hardware)
    return spec if max_alloc_gib is None else spec.with_max_alloc_gib(max_alloc_gib)


def local_node():  # noqa: ANN201
    """This machine's spec (probed once, then cached), after one line on stderr saying which."""
    from planner.specs.hardware import NodeSpec
    from planner.specs.history import default_cache_dir
    from tierwise.cli.machine import require_runtime

    require_runtime("--hardware local")
    from runtime.local_hardware import default_probe, local_hardware

    cache_dir = default_cache_dir()

    def probe() -> dict:  # the one line, said before the wait rather than after it
        sys.stderr.write(f"hardware local: probing this machine (under a minute on 2 cores), cached in {cache_dir}\n")
        return default_probe()()

    found = local_hardware(cache_dir, probe=probe)
    try:
        spec = NodeSpec.from_dict(found.document, str(found.path))
    except PlannerError:  # a cache written by another version: measure again
        found = local_hardware(cache_dir, probe=probe, refresh=True)
        spec = NodeSpec.from_dict(found.document, str(found.path))
    if not found.probed:
        sys.stderr.write(found.line() + "\n")
    return spec


def precision(node, pinned: str | None) -> str:  # noqa: ANN001
    """The plan's precision on `node`: `pinned`, else bf16 unless `node` emulates it
    (planner/specs/precision.py [Note: emulated precisions]); its note, if any, on stderr."""
    from planner.specs.precision import PRECISIONS, choose_precision
    from planner.specs.specio import string

    if pinned is not None:
        string(pinned, "--precision", choices=PRECISIONS)
    choice = choose_precision(dict(node.precision_rates), node.name, pinned)
    if choice.note:
        sys.stderr.write(choice.note + "\n")
    return choice.precision


LockedMemoryOpt = Annotated[str | None, typer.Option(
    "--locked-memory", help="page-locked memory one training process may hold: 'unlimited', 'local' (this "
                            "machine's ulimit -l) or GiB; default 'local' for --hardware local or a hardware JSON file, else 'unlimited'")]


def locked_memory_bytes(text: str | None, hardware: str | None) -> float:
    """`--locked-memory` in bytes: a named preset is planned as unlimited, `--hardware local` or a
    hardware file (what `planner probe` writes for the machine it runs on) at this machine's RLIMIT_MEMLOCK."""
    from planner.specs.specio import number

    if text is None:
        text = "local" if hardware == "local" or (hardware is not None and Path(hardware).is_file()) else "unlimited"
    word = text.strip().lower()
    if word == "unlimited":
        return float("inf")
    if word == "local":
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return float("inf") if soft == resource.RLIM_INFINITY else float(soft)
    try:
        gib = float(word)
    except ValueError:
        raise PlannerError(f"--locked-memory takes 'unlimited', 'local' or a size in GiB, not {text!r}") from None
    return number(gib, "--locked-memory", minimum=0) * 1024**3


def print_json(doc) -> None:  # noqa: ANN001
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def one_line_error(exc: PlannerError) -> str:
    """The message as one line, whatever the offending value contained (never wrapped by rich)."""
    return "error: " + " ".join(str(exc).split()) + "\n"


def exit_on_error(fn: Callable[[], int | None]) -> None:
    """Run a verb's body; a PlannerError becomes one line on stderr and exit code 1."""
    try:
        code = fn()
    except PlannerError as exc:
        sys.stderr.write(one_line_error(exc))
        raise typer.Exit(1) from None
    raise typer.Exit(code or 0)
