"""`planner run`: execute a plan with the bundled runtime (`planner compare` then checks the plan).

`run` launches `runtime.launch` through torchrun (multi-node: pass torchrun's own arguments after
`--`, e.g. `planner run plan.json -- --nnodes 2 --node_rank 0 --rdzv_endpoint host:29400`), says
what it is doing (tierwise/cli/run_progress.py: each stage, each step with its loss, step time and the
time left, the loss curve at the end), and writes the profile. A plan the runtime cannot execute is
refused before any process starts (model parallelism, unsupported placement, the wrong process
count) or by the workers before training (memory that is not there), always as one line.
`--save-every N --checkpoint-dir DIR` saves training checkpoints (runtime/ckpt) and lets torchrun restart failed workers (`--max-restarts`,
default 3 with checkpoints, 0 without), which resume from the newest complete training checkpoint;
`--resume` continues a run that was stopped. `--nvme-path DIR` overrides the plan's swap directory
(created when its parent exists; without either, a `tierwise-swap` folder in the user's cache:
planner/cost/swap.py). Before launching, `machine` names a missing runtime extra in one
line and compares the plan's hardware with this machine (a one-line warning, or the real cause of
a refusal). This module imports no torch at import time; `machine.this_machine` does, once the run
is about to need it anyway.

`--model CONFIG.json|PRESET` trains that Hugging Face architecture instead of the reference GPT, and
`--init-from DIR` starts from a Hugging Face folder's weights (its config.json is the model unless
`--model` says otherwise): runtime/hf_model.py. Both are checked here before any process starts
(the hf extra installed, a supported config, the model the plan was made for, the folder's files);
the workers load the weights unit by unit and check every key.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from planner.specs import catalog, hf_config
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan, load_plan
from planner.specs.specio import load_document
from tierwise.cli import machine
from tierwise.cli import options as o
from tierwise.cli.run_progress import RunProgress

EVENT = "TIERWISE_EVENT"
ERROR = "TIERWISE_ERROR"


def precheck(plan: Plan, nproc: int, nnodes: int) -> None:
    """What can be refused without starting a process (the workers check memory themselves)."""
    from planner.cost.swap import swap_space_problem

    problem = swap_space_problem(plan)
    if problem is not None:
        raise PlannerError(problem)
    if nproc * nnodes != plan.num_gpus:  # named by the options that start the processes
        raise PlannerError(f"--nproc {nproc} x {nnodes} node(s) starts {nproc * nnodes} process(es) but the plan is for "
                           f"num_gpus {plan.num_gpus}; match them or re-plan")
    from runtime.plan_check import executable_problem  # torch-free

    problem = executable_problem(plan, world_size=nproc * nnodes)
    if problem is not None:
        raise PlannerError(problem)
    if plan.micro_batch_per_gpu != int(plan.micro_batch_per_gpu):
        raise PlannerError(f"micro_batch_per_gpu {plan.micro_batch_per_gpu} must be a whole number of samples to run")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointOptions:
    """`planner run`'s training-checkpoint options, passed through to every worker."""

    save_every: int = 0
    """Checkpoint every N steps and at the last (0: never)."""
    checkpoint_dir: Path | None = None
    keep: int = 2
    """Complete checkpoints kept (older ones are deleted once a newer one is complete)."""
    resume: bool = False
    max_restarts: int | None = None
    """torchrun's restarts of failed workers; default 3 with checkpoints (they resume), else 0."""

    def check(self) -> None:
        if self.save_every < 0:
            raise PlannerError(f"--save-every must be 0 (never) or a number of steps, got {self.save_every}")
        if self.keep < 1:
            raise PlannerError(f"--keep-checkpoints must be at least 1, got {self.keep}")
        if (self.save_every or self.resume) and self.checkpoint_dir is None:
            raise PlannerError("--save-every and --resume need --checkpoint-dir DIR")
        if self.max_restarts is not None and not 0 <= self.max_restarts <= 100:
            raise PlannerError(f"--max-restarts must be from 0 to 100, got {self.max_restarts}")

    def launch_args(self) -> list[str]:
        if self.checkpoint_dir is None:
            return []
        out = ["--save-every", str(self.save_every), "--checkpoint-dir", str(self.checkpoint_dir),
               "--keep-checkpoints", str(self.keep)]
        return out + (["--resume"] if self.resume else [])

    def restarts(self) -> int:
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.save_every else 0


@dataclass(frozen=True, kw_only=True, slots=True)
class HfModel:
    """A Hugging Face architecture to train (`--model`), and the folder to start from (`--init-from`)."""

    config: dict
    """Its config.json, as transformers reads it."""
    label: str
    """Where the config came from (a file, a preset, DIR/config.json), for messages."""
    init_from: Path | None = None


HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
INSTALL_HF = "pip install 'tierwise[hf]'"


def hf_model_of(model: str | None, init_from: Path | None) -> HfModel | None:
    """`--model` / `--init-from` resolved and checked (torch-free); None without either."""
    if model is None and init_from is None:
        return None
    if init_from is not None:
        init_from = init_from.resolve()
        if not init_from.is_dir():
            raise PlannerError(f"--init-from {init_from} is not a directory (a Hugging Face model folder)")
        if not any((init_from / name).is_file() for name in HF_WEIGHTS):
            raise PlannerError(f"--init-from {init_from} has neither {' nor '.join(HF_WEIGHTS)}: save the model "
                               "with save_pretrained(DIR) (safetensors, the default)")
    if model is None:
        assert init_from is not None
        path = init_from / "config.json"
        if not path.is_file():
            raise PlannerError(f"--init-from {init_from} has no config.json; pass --model CONFIG.json")
        config, label = load_document(path, "model"), str(path)
    elif Path(model).is_file():
        config, label = load_document(Path(model), "model"), model
    else:
        config, label = catalog.published_hf_config(model), model
        if config is None:
            raise PlannerError(f"--model {model}: neither a config.json file nor a preset with a Hugging Face config "
                               "(see `planner models`)")
    if not hf_config.is_hf_config(config):
        raise PlannerError(f"--model {label} is not a Hugging Face config.json (no model_type, num_hidden_layers, ...)")
    return HfModel(config=config, label=label, init_from=init_from)


def check_hf_model(hf: HfModel, plan: Plan) -> None:
    """A supported config of the model the plan was made for, and the hf extra to build it."""
    from runtime.model_check import ModelShape, mismatch  # torch-free

    spec = hf_config.spec_from_hf_config(hf.config, name=hf.label, where=f"--model {hf.label}")
    problem = mismatch(plan.model, ModelShape.of_model_spec(spec, plan.model),
                       hint=f"make a plan for it with `planner fit {hf.label}`")
    if problem is not None:
        raise PlannerError(problem)
    missing = [name for name in ("transformers", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        raise PlannerError(f"planner run --model/--init-from needs the hf extra ({', '.join(missing)} not installed): "
                           f"{INSTALL_HF}")


def torchrun_command(plan_path: Path, *, steps: int, nproc: int, data: Path | None, profile_out: Path | None,
                     torchrun_args: list[str], checkpoints: CheckpointOptions | None = None,
                     model_args: list[str] | None = None) -> list[str]:
    checkpoints = checkpoints or CheckpointOptions()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += torchrun_args or ["--standalone", "--nnodes", "1"]
    if not any(a == "--max-restarts" or a.startswith("--max-restarts=") or a.startswith("--max_restarts")
               for a in torchrun_args):
        cmd += ["--max-restarts", str(checkpoints.restarts())]
    cmd += ["-m", "runtime.launch", str(plan_path), "--steps", str(steps)]
    if data is not None:
        cmd += ["--data", str(data)]
    if profile_out is not None:
        cmd += ["--profile-out", str(profile_out)]
    return cmd + checkpoints.launch_args() + (model_args or [])


def _nnodes(torchrun_args: list[str]) -> int:
    for i, arg in enumerate(torchrun_args):
        value = arg.split("=", 1)[1] if arg.startswith("--nnodes=") else (
            torchrun_args[i + 1] if arg == "--nnodes" and i + 1 < len(torchrun_args) else None)
        if value is not None:
            try:
                return int(value.split(":")[-1])
            except ValueError:
                raise PlannerError(f"--nnodes {value!r} must be a number (or MIN:MAX)") from None
    return 1


def swap_directory(nvme_path: str) -> str:
    """`nvme_path` as an existing directory: created when only its last part is missing."""
    path = Path(nvme_path).expanduser()
    if not path.exists():
        if not path.parent.is_dir():
            raise PlannerError(f"nvme_path {path}: its parent {path.parent} is not an existing directory; "
                               "create it or choose another directory")
        try:
            path.mkdir()
        except OSError as exc:
            raise PlannerError(f"cannot create nvme_path {path}: {exc.strerror or exc}") from None
    return str(path)


def with_swap_directory(plan: Plan, nvme_path: Path | None) -> Plan:
    """The plan with `--nvme-path` (when given) as its swap directory, created if it is missing; a
    plan with NVMe states and no directory swaps to the default folder (planner/cost/swap.py)."""
    from planner.cost.swap import with_default_swap

    if nvme_path is not None:
        plan = plan.replace(nvme_path=str(nvme_path))
    if plan.placement.model_states_on_nvme and plan.nvme_path:
        return plan.replace(nvme_path=swap_directory(plan.nvme_path))
    return with_default_swap(plan)


def run_plan(plan_path: Path, *, steps: int, nproc: int | None, data: Path | None, profile_out: Path | None,
             torchrun_args: list[str], console: Console, history_store: Path | None = None,
             record_history: bool = True, checkpoints: CheckpointOptions | None = None,
             nvme_path: Path | None = None, model: str | None = None, init_from: Path | None = None) -> int:
    from planner.cost.feasibility import check_plan  # the cost models load with the verb, not at start

    checkpoints = checkpoints or CheckpointOptions()
    checkpoints.check()
    hf = hf_model_of(model, init_from)
    loaded = check_plan(load_plan(plan_path))
    plan = with_swap_directory(loaded, nvme_path)
    nnodes = _nnodes(torchrun_args)
    nproc = nproc or plan.num_gpus // nnodes
    precheck(plan, nproc, nnodes)
    if steps < 1:
        raise PlannerError(f"--steps must be at least 1, got {steps}")
    if data is not None and not data.is_file():
        raise PlannerError(f"--data {data} is not a readable file")
    machine.require_runtime("run")
    if hf is not None:
        check_hf_model(hf, plan)
    progress = progress_for(plan, steps, console)
    progress.checking(plan_path)  # before this_machine's torch import, seconds on a small machine
    if hf is not None:
        for line in hf_config.notes(hf.config, f"--model {hf.label}", seq_given=True).lines():
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    warning = machine.check(plan, machine.this_machine(), nproc)
    if warning:
        console.print(warning, markup=False, highlight=False, soft_wrap=True)
    else:  # the plan's prediction is for this machine: it estimates the run before a step is measured
        progress.predicted_step_s = progress.plan_step_s
    with tempfile.TemporaryDirectory(prefix="tierwise-run-") as tmp:
        if plan != loaded:  # the workers read the plan as run, --nvme-path included
            plan_path = Path(tmp, "plan.json")
            plan.save(plan_path)
        written = profile_out or Path(tmp, "profile.json")
        model_args = []
        if hf is not None:  # the workers read the config from a file, a preset's too
            Path(tmp, "model-config.json").write_text(json.dumps(hf.config))
            model_args = ["--model", str(Path(tmp, "model-config.json"))]
            model_args += ["--init-from", str(hf.init_from)] if hf.init_from is not None else []
        code = _launch(torchrun_command(plan_path, steps=steps, nproc=nproc, data=data, profile_out=written,
                                        torchrun_args=torchrun_args, checkpoints=checkpoints, model_args=model_args),
                       progress, nproc)
        if profile_out is not None:
            console.print(f"profile written to {profile_out}")
        if record_history and written.exists():
            from planner.specs.history import RunHistory

            run_id = RunHistory(history_store).append(plan, json.loads(written.read_text()))
            console.print(f"recorded as run {run_id} in the run history")
    return code


REPLAN_HINT = ("Plan for this machine: planner fit MODEL --hardware local, or planner probe --out hw.json and then "
               "planner fit MODEL --hardware hw.json")


def progress_for(plan: Plan, steps: int, console: Console) -> RunProgress:
    """The run's progress lines; `predicted_step_s` is set once the plan is known to be for here."""
    predicted = plan.prediction.iteration_time_s if plan.prediction and plan.prediction.iteration_time_s else None
    return RunProgress(console=console, steps=steps, predicted_step_s=None, plan_step_s=predicted,
                       hardware=f" for {plan.node.name}", replan_hint=REPLAN_HINT)


def _launch(cmd: list[str], progress: RunProgress, processes: int) -> int:
    tail: deque[str] = deque(maxlen=30)
    error = None
    progress.started(processes)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    progress.beat_in_background()
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith(EVENT):
            _event(json.loads(line[len(EVENT):]), progress)
        elif line.startswith(ERROR):
            error = line[len(ERROR):].strip()
        else:
            tail.append(line)
    code = proc.wait()
    progress.finished()
    if error and error.startswith("rank "):  # a worker stopped during training (see runtime/launch.py)
        raise PlannerError(f"the run stopped: {error}")
    if error:
        raise PlannerError(f"the runtime refused the plan: {error}")
    if code != 0:
        progress.console.print("\n".join(tail), style="dim", markup=False, highlight=False)
        raise PlannerError(f"training failed (torchrun exit code {code}); the workers' last output is above")
    return 0


def _event(event: dict, progress: RunProgress) -> None:
    """One TIERWISE_EVENT of rank 0 (runtime/launch.py) onto the progress lines."""
    if "step" in event:
        progress.step(event["step"], event["loss"], event["step_time_s"])
    elif "stage" in event:
        progress.stage(event["stage"])
    elif "training_from_step" in event:
        progress.training(event["training_from_step"])
    elif "resumed_from_step" in event:
        progress.resumed(event["resumed_from_step"])


def register(app: typer.Typer) -> None:
    @app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def run_cmd(
        ctx: typer.Context,
        plan: Annotated[Path, typer.Argument(help="plan JSON written by `planner fit --out`", click_type=o.PATH)],
        steps: Annotated[int, typer.Option(help="training steps")] = 10,
        nproc: Annotated[int | None, typer.Option(help="processes (GPUs) per node; default: the plan's")] = None,
        data: Annotated[Path | None, typer.Option(help="text file, tokenised byte-level; default synthetic", click_type=o.PATH)] = None,
        profile_out: Annotated[Path | None, typer.Option(help="write the profile JSON here", click_type=o.PATH)] = None,
        store: o.StoreOpt = None,
        history: Annotated[bool, typer.Option(help="record the run in the run history")] = True,
        save_every: Annotated[int, typer.Option(help="save a training checkpoint every N steps and at the last (0: never)")] = 0,
        checkpoint_dir: Annotated[Path | None, typer.Option(help="directory of the run's training checkpoints (shared by all nodes)", click_type=o.PATH)] = None,
        keep_checkpoints: Annotated[int, typer.Option(help="complete training checkpoints to keep")] = 2,
        resume: Annotated[bool, typer.Option("--resume", help="continue from the newest complete training checkpoint")] = False,
        max_restarts: Annotated[int | None, typer.Option(help="torchrun restarts of failed workers (default 3 with --save-every, else 0)")] = None,
        nvme_path: Annotated[Path | None, typer.Option(
            "--nvme-path", help="swap directory for the plan's NVMe states (overrides the plan's; created if its "
                                "parent exists)", click_type=o.PATH)] = None,
        model: Annotated[str | None, typer.Option(
            "--model", help="train this Hugging Face architecture (a config.json or a preset with one, see "
                            "`planner models`) instead of the reference GPT")] = None,
        init_from: Annotated[Path | None, typer.Option(
            "--init-from", help="start from a Hugging Face folder's weights (config.json + safetensors)", click_type=o.PATH)] = None,
    ) -> None:
        """Train the plan's reference GPT (or `--model`, `--init-from`: a Hugging Face model) with the
        bundled runtime (torchrun) and write a profile. Arguments after `--` go to torchrun (multi-node)."""
        checkpoints = CheckpointOptions(save_every=save_every, checkpoint_dir=checkpoint_dir, keep=keep_checkpoints,
                                        resume=resume, max_restarts=max_restarts)
        o.exit_on_error(lambda: run_plan(plan, steps=steps, nproc=nproc, data=data, profile_out=profile_out,
                                         torchrun_args=list(ctx.args), console=Console(stderr=True),
                                         history_store=store, record_history=history, checkpoints=checkpoints,
                                         nvme_path=nvme_path, model=model, init_from=init_from))
