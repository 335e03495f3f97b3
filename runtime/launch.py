"""Worker entry of `planner run`: one process per rank, started by torchrun.

    torchrun --nproc_per_node P -m runtime.launch PLAN.json --steps N [--data FILE] [--profile-out F]
             [--save-every K --checkpoint-dir DIR [--keep-checkpoints 2] [--resume]]
             [--model CONFIG.json] [--init-from HF_DIR]

Builds the plan's reference GPT on the meta device (or, with `--model`, the Hugging Face architecture
of that config.json; with `--init-from`, of the folder's config.json, its weights loaded unit by
unit: runtime/hf_model.py) and materialises it shard by shard (construction-time partitioning), trains N steps on synthetic tokens or a byte-level tokenised text
file, and writes the profile (rank 0). Rank 0 reports progress as `TIERWISE_EVENT {json}` lines on
stdout, and a plan it cannot run as one `TIERWISE_ERROR message` line (exit code 3), which the CLI
turns into its progress bar and its one-line errors. An error during training (a full disk, an I/O
error from the NVMe engine, an unusable checkpoint) is one `TIERWISE_ERROR` line from the rank that
hit it (exit code 4).

With `--save-every K` every K-th step (and the last) is checkpointed (runtime/ckpt); `--resume`, and
any restart by torchrun (`--max-restarts`), continues from the newest complete checkpoint, with
bitwise the losses of an uninterrupted run: the data order is a function of the step, and the RNG
states are part of the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from planner.cost.feasibility import check_plan
from planner.cost.swap import with_default_swap
from planner.specs.errors import PlannerError
from planner.specs.plan import LINKS, PHASES, TIERS, Plan, Prediction, load_plan
from planner.specs.profile import Profile, StepSample
from planner.specs.units import TFLOP
from runtime.host_malloc import keep_freed_memory_mapped
from runtime.plan_io import PlanNotExecutable, check_executable, check_memory
from runtime.profiler import process_peak_rss_bytes

EVENT = "TIERWISE_EVENT"
ERROR = "TIERWISE_ERROR"
EXIT_NOT_EXECUTABLE = 3
EXIT_TRAINING_FAILED = 4


WARMUP_STEPS = 2
"""Steps left out of the profile's measured figures. The first records the operator order and runs
without prefetching; the second is still slower than the rest, in plain PyTorch too (allocator and
kernel warm-up; docs/notes/2026-11-22-runtime-source-measurements.md). The simulator predicts the
steady state, so a profile compares with it from the third step on."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="runtime.launch")
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--data", default=None, help="text file, tokenised byte-level; default: synthetic tokens")
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--keep-checkpoints", type=int, default=2)
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    ap.add_argument("--model", default=None, help="a Hugging Face config.json: train that architecture")
    ap.add_argument("--init-from", default=None, help="a Hugging Face folder (config.json, safetensors) to start from")
    args = ap.parse_args(argv)
    keep_freed_memory_mapped()  # before the model's first buffers ([Note: glibc's mmap threshold])
    # A worker restarted by torchrun (--max-restarts) resumes: that is what the checkpoints are for.
    args.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        bind_device()  # before any collective or allocation ([Note: one device per rank])
    except PlannerError as exc:
        print(f"{ERROR} rank {rank}: {exc}", flush=True)
        return EXIT_NOT_EXECUTABLE
    if world_size > 1:
        init_process_group(rank=rank, world_size=world_size)
    try:
        plan = with_default_swap(check_plan(load_plan(args.plan)))
        check_executable(plan, world_size=world_size)
        check_memory(plan)
        if args.steps < 1:
            raise PlannerError(f"--steps must be at least 1, got {args.steps}")
        if plan.micro_batch_per_gpu != int(plan.micro_batch_per_gpu):
            raise PlanNotExecutable(f"micro_batch_per_gpu {plan.micro_batch_per_gpu} must be a whole number of samples")
        tokens = load_tokens(args.data, plan) if args.data else None
        checkpointer = make_checkpointer(args, plan, rank=rank, world_size=world_size)
        stage(rank, "building the model on the meta device" if args.init_from is None
              else f"building the model on the meta device (weights from {args.init_from})")
        built = build_model(plan, args)
    except PlannerError as exc:
        if rank == 0:
            print(f"{ERROR} {exc}", flush=True)
        return EXIT_NOT_EXECUTABLE
    try:
        profile = train(plan, args, tokens, built, rank=rank, world_size=world_size, checkpointer=checkpointer)
    except PlannerError as exc:
        print(f"{ERROR} rank {rank}: {exc}", flush=True)
        return EXIT_TRAINING_FAILED
    except OSError as exc:
        print(f"{ERROR} rank {rank}: {describe_io_error(exc)}", flush=True)
        return EXIT_TRAINING_FAILED
    if rank == 0 and args.profile_out and profile is not None:
        profile.save(args.profile_out)
    if world_size > 1:
        dist.barrier()  # no rank tears down gloo/NCCL pairs while a peer still uses them
        dist.destroy_process_group()
    return 0


def stage(rank: int, what: str) -> None:
    """Rank 0 says which stage starts (`planner run` prints it with the time since the start)."""
    if rank == 0:
        print(f"{EVENT} " + json.dumps({"stage": what}), flush=True)


def bind_device() -> torch.device:
    """Make `cuda:LOCAL_RANK` this process's current device (the CPU without CUDA) and return it.

    [Note: one device per rank]
    NCCL's object collectives (`all_gather_object` here and in runtime/ckpt) stage their bytes on
    the current device, `torch.cuda.mem_get_info()` reports it, and pinned host memory is attached
    to its context: without `set_device` every rank of a node would use cuda:0. It must run before
    the process group exists and before the first CUDA allocation."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not 0 <= local_rank < torch.cuda.device_count():
        raise PlannerError(f"LOCAL_RANK {local_rank} names no GPU: this node has {torch.cuda.device_count()}; "
                           "start at most that many processes per node")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_process_group(*, rank: int, world_size: int) -> None:
    """torch.distributed's default group; on a torchrun restart, in a fresh key space of the store.

    [Note: process groups after a torchrun restart]
    torchrun's workers share the agent's TCPStore, and a restarted worker group gets the same
    store: the previous attempt's keys (the dead ranks' gloo addresses) are still there, and the new
    ranks connect to them (connection refused, or a hang). Prefixing the keys with the restart count
    gives every attempt its own."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timedelta(minutes=10))
    dist.init_process_group(backend, store=dist.PrefixStore(f"tierwise/attempt_{restart}", store), rank=rank,
                            world_size=world_size)


def make_checkpointer(args: argparse.Namespace, plan: Plan, *, rank: int, world_size: int):  # noqa: ANN201
    """The run's `Checkpointer`, or None without --save-every / --resume; bad options are one line."""
    if args.save_every < 0:
        raise PlannerError(f"--save-every must be 0 (never) or a number of steps, got {args.save_every}")
    if args.keep_checkpoints < 1:
        raise PlannerError(f"--keep-checkpoints must be at least 1, got {args.keep_checkpoints}")
    if not (args.save_every or args.resume):
        return None
    if not args.checkpoint_dir:
        raise PlannerError("--save-every and --resume need --checkpoint-dir DIR")
    from runtime.ckpt import Checkpointer

    return Checkpointer(args.checkpoint_dir, plan=plan, seed=args.seed, rank=rank, world_size=world_size,
                        resume=args.resume, keep=args.keep_checkpoints, restarted=args.restarted,
                        run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""))


def describe_io_error(exc: OSError) -> str:
    """One line for an I/O error during training: what failed, on which file, and where."""
    where = ""
    if getattr(exc, "offset", None) is not None:
        where = f" ({'read' if 'read' in str(exc.args[-1]) else 'write'} of {exc.nbytes} bytes at offset {exc.offset})"
    name = exc.filename or "an unnamed file"
    hint = "; free space there" if exc.errno in (28, 27, 122) else ""  # ENOSPC, EFBIG, EDQUOT
    return f"I/O error on {name}: {exc.strerror or exc}{where}{hint}; checkpoints already written are intact"


def load_tokens(path: str, plan: Plan) -> torch.Tensor:
    """Byte-level tokens of a text file (vocabulary 256; a smaller one holds text whose bytes it covers)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PlannerError(f"cannot read --data {path}: {exc.strerror or exc}") from None
    if len(raw) < plan.model.seq_len + 1:
        raise PlannerError(f"--data {path} has {len(raw)} bytes; it needs at least seq_len + 1 = {plan.model.seq_len + 1}")
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    top = int(tokens.max())
    if 0 < plan.model.vocab_size <= top:  # ASCII text fits a vocabulary of 128
        raise PlannerError(f"--data {path} has byte values up to {top}, beyond the plan's vocab_size "
                           f"{plan.model.vocab_size}: byte-level tokens need vocab_size above the largest byte (or 0)")
    return tokens


def batch_for(step: int, rank: int, plan: Plan, vocab: int, tokens: torch.Tensor | None, seed: int) -> torch.Tensor:
    """(B, T + 1) tokens for this rank and step: random windows of the text, or synthetic tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + rank)
    batch, seq = int(plan.micro_batch_per_gpu), plan.model.seq_len
    if tokens is None:
        return torch.randint(0, vocab, (batch, seq + 1), generator=g)
    starts = torch.randint(0, tokens.numel() - seq, (batch,), generator=g)
    return torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])


class Built(NamedTuple):
    """The model to train, on the meta device, and how to initialise it and score a batch."""

    model: torch.nn.Module
    init_fn: Callable[[torch.nn.Module], None] | None
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    """(model, (B, T + 1) tokens) -> mean next-token loss over the B x T predictions."""
    vocab_size: int


def gpt_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss


def build_model(plan: Plan, args: argparse.Namespace) -> Built:
    """The plan's reference GPT, or the `--model` / `--init-from` Hugging Face architecture, checked
    against the plan ([Note: model vs plan] in runtime/model_check.py) before anything is allocated."""
    from runtime.model_check import check_model

    torch.manual_seed(args.seed)
    random.seed(args.seed)  # ours does not draw from it, but a user's data pipeline may: runs are reproducible
    if args.model is None and args.init_from is None:
        from runtime.gpt import GPT, GPTConfig, init_weights

        cfg = GPTConfig.from_model_spec(plan.model)
        with torch.device("meta"):
            model = GPT(cfg)
        return Built(model, init_weights, gpt_loss, cfg.vocab_size)
    from runtime import hf_model

    config = hf_model.read_config(args.model or Path(args.init_from, "config.json"))
    model = hf_model.build_model(config)
    check_model(model, plan.model)
    init_fn = hf_model.from_safetensors(model, args.init_from) if args.init_from else None
    return Built(model, init_fn, hf_model.causal_lm_loss, model.config.vocab_size)


def train(plan: Plan, args: argparse.Namespace, tokens: torch.Tensor | None, built: Built, *, rank: int,
          world_size: int, checkpointer=None) -> Profile | None:  # noqa: ANN001 - runtime.ckpt.Checkpointer
    import runtime

    where = ", ".join(f"{state} {tier}" for state, tier in plan.placement.to_dict().items())
    stage(rank, f"materialising the model unit by unit ({plan.model.num_layers} layers; {where})")
    model = runtime.shard(built.model, plan, param_init_fn=built.init_fn)
    state = runtime.state_of(model)
    state.profiler.keep_samples(args.steps)  # the profile has one sample per step
    optimizer = runtime.AdamW(model, lr=args.lr, weight_decay=0.1)
    try:
        profile = _train_loop(plan, args, tokens, model, optimizer, built, rank=rank, world_size=world_size,
                              checkpointer=checkpointer)
    except BaseException:
        # Swap files of an NVMe placement go now, not at interpreter exit; the error that stopped
        # the run is the one to report, not a second one from transfers still failing while closing.
        with contextlib.suppress(Exception):
            optimizer.close()
        with contextlib.suppress(Exception):
            state.close()
        raise
    optimizer.close()
    state.close()
    return profile


def _train_loop(plan: Plan, args: argparse.Namespace, tokens: torch.Tensor | None, model: torch.nn.Module,
                optimizer, built: Built, *, rank: int, world_size: int, checkpointer) -> Profile | None:  # noqa: ANN001
    import runtime
    from runtime.faults import fault_point

    state = runtime.state_of(model)
    device = state.config.device
    losses: list[float] = []
    first_step = 1
    if checkpointer is not None and args.save_every:
        checkpointer.preflight(state, optimizer)
    if checkpointer is not None and (args.resume or args.restarted):
        restored = checkpointer.restore(state, optimizer)
        if restored is not None:
            first_step = restored["step"] + 1
            if state.loss_scaler is not None and restored.get("loss_scaler"):
                state.loss_scaler.load_state_dict(restored["loss_scaler"])
            optimizer.num_skipped_steps = restored.get("num_skipped_steps", 0)
            if rank == 0:
                print(f"{EVENT} " + json.dumps({"resumed_from_step": restored["step"]}), flush=True)
        elif rank == 0:
            print(f"warning: no complete checkpoint in {checkpointer.root}; starting at step 1", file=sys.stderr,
                  flush=True)
    if first_step > args.steps:  # the checkpoint is already at (or past) the last step
        if rank == 0:
            print(f"warning: the newest checkpoint is at step {first_step - 1}; nothing left to train for --steps "
                  f"{args.steps}", file=sys.stderr, flush=True)
        return None
    if rank == 0:
        print(f"{EVENT} " + json.dumps({"training_from_step": first_step}), flush=True)
    for step in range(first_step, args.steps + 1):
        # The data position is the step itself: batch_for draws from a generator seeded by it.
        batch = batch_for(step, rank, plan, built.vocab_size, tokens, args.seed).to(device)
        loss = built.loss_fn(model, batch)
        loss.backward()
        fault_point("train.step", step=step, rank=rank)
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().float().clone()
        if world_size > 1:
            dist.all_reduce(value)
        losses.append(value.item() / world_size)
        sample = state.profiler.samples[-1]
        if rank == 0:
            print(f"{EVENT} " + json.dumps({"step": step, "steps": args.steps, "loss": losses[-1],
                                              "step_time_s": sample.step_time_s}), flush=True)
        if checkpointer is not None and args.save_every and (step % args.save_every == 0 or step == args.steps):
            scaler = state.loss_scaler.state_dict() if state.loss_scaler is not None else None
            checkpointer.save(step, state, optimizer, scalars={"loss_scaler": scaler,
                                                               "num_skipped_steps": optimizer.num_skipped_steps})
    local = [s.to_dict() for s in state.profiler.samples]
    extra = {"peak_rss_bytes": process_peak_rss_bytes(), "order_changes": state.prefetcher.num_order_changes}
    gathered = [(local, extra)]
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (local, extra))
    num_params = sum(u.layout.numel for u in state.units)
    return build_profile(plan, gathered, losses, args.warmup_steps, device=str(device), num_params_run=num_params,
                         first_step=first_step)


def build_profile(plan: Plan, per_rank: list, losses: list[float], warmup_steps: int, *, device: str,
                  num_params_run: int, first_step: int = 1) -> Profile:
    """Rank 0's view of the run in the plan's units: gpu per GPU (max over ranks), cpu per node."""
    num_steps = len(losses)
    ranks_per_node = max(1, len(per_rank) // plan.num_nodes)
    samples = []
    for i in range(num_steps):
        steps = [rank_samples[i] for rank_samples, _ in per_rank]
        first = steps[0]
        # A per-GPU tier's peak is the worst rank's; a per-node tier's is the node's ranks' sum.
        peak = {tier: max(s["peak_bytes"][tier] for s in steps) if tier.per_gpu
                else sum(s["peak_bytes"][tier] for s in steps) // plan.num_nodes for tier in TIERS}
        samples.append(StepSample(step=first_step + i, step_time_s=max(s["step_time_s"] for s in steps), loss=losses[i],
                                  phase_time_s={k: first["phase_time_s"].get(k, 0.0) for k in PHASES},
                                  link_bytes={k: int(first["link_bytes"].get(k, 0)) for k in LINKS},
                                  peak_bytes=peak))
    measured_steps = samples[warmup_steps:] or samples
    raw_measured = [rs for rs, _ in per_rank]
    iteration = statistics.mean(s.step_time_s for s in measured_steps)
    tokens_per_gpu = plan.micro_batch_per_gpu * plan.model.seq_len
    # Paper accounting (eq. 7): 8 * tokens * params with recompute, 6 * tokens * params without.
    flops_per_token = (8 if plan.recompute_interval else 6) * plan.model.num_params
    worst = max(range(len(measured_steps)), key=lambda j: measured_steps[j].peak_bytes["gpu"])
    index = warmup_steps + worst if len(samples) > warmup_steps else worst
    terms = {tier: {k: int(v) * (1 if tier.per_gpu else ranks_per_node) for k, v in
                    raw_measured[0][index].get("terms_at_peak", {}).get(tier, {}).items()} for tier in TIERS}
    measured = Prediction(
        feasible=True,
        iteration_time_s=iteration,
        tflops_per_gpu=flops_per_token * tokens_per_gpu / iteration / TFLOP,
        tokens_per_s=tokens_per_gpu * plan.num_gpus / iteration,
        bottleneck="",
        peak_bytes={t: max(s.peak_bytes[t] for s in measured_steps) for t in TIERS},
        capacity_bytes={tier: int(tier.capacity_bytes(plan.node)) for tier in TIERS},
        phase_time_s={k: statistics.mean(s.phase_time_s[k] for s in measured_steps) for k in PHASES},
        link_bytes={k: int(statistics.mean(s.link_bytes[k] for s in measured_steps)) for k in LINKS},
        memory_terms=terms,
        method="measured",
        details={"tflops_accounting": "paper eq. 7: 8 x tokens x params with recompute, 6 x without"},
    )
    details = {
        "world_size": len(per_rank),
        "device": device,
        "host": platform.node(),
        "torch": torch.__version__,
        "num_params_run": num_params_run,
        "peak_rss_bytes_per_rank": [extra["peak_rss_bytes"] for _, extra in per_rank],
        "cuda_max_allocated_bytes": max(rs[index].get("cuda_max_allocated_bytes", 0) for rs, _ in per_rank),
        "prefetch_order_changes": per_rank[0][1]["order_changes"],
    }
    return Profile(measured=measured, samples=tuple(samples), warmup_steps=min(warmup_steps, num_steps),
                   plan=plan.to_dict(), details=details)


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from runtime.process_exit import leave

        leave(code)  # [Note: a rank leaves with os._exit]
    sys.exit(code)
