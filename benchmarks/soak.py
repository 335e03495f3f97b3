"""Soak: hundreds of training steps on NVMe with checkpoints, watching for anything that grows.

    python benchmarks/soak.py [--steps 400] [--sample-every 20] [--save-every 50] [--write-results]

A small GPT with params, gradients and optimizer states on NVMe (swap files under a temporary
`nvme_path`) trains with a checkpoint every `--save-every` steps; every `--sample-every` steps the
process's resident memory (RSS and anonymous RSS), open file descriptors, threads (io_uring's
kernel workers, which the kernel starts and retires on demand, counted apart) and the swap
files' sizes (apparent and allocated) are sampled. After a warm-up (the first checkpoint) nothing may
grow from the first half of the samples to the second: fds, threads and swap-file sizes not at
all, RSS by at most `--rss-tolerance-mib` (allocator noise). Prints JSON; `--write-results` writes the
`soak` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def _thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


def sample(step: int, swap_root: Path) -> dict[str, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    files = [p for d in swap_root.iterdir() for p in d.iterdir()]
    return {"step": step,
            "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
            "anon_rss_bytes": int(status["RssAnon"].split()[0]) * 1024,
            "open_fds": len(os.listdir("/proc/self/fd")),
            # io_uring's kernel workers (`iou-wrk-*`) are started and retired by the kernel on demand
            # (bounded by io-wq's limits): counted apart, not as our threads.
            "threads": sum(not n.startswith("iou-wrk") for n in _thread_names()),
            "io_uring_kernel_workers": sum(n.startswith("iou-wrk") for n in _thread_names()),
            "swap_apparent_bytes": sum(p.stat().st_size for p in files),
            "swap_allocated_bytes": sum(p.stat().st_blocks * 512 for p in files)}


def soak(*, steps: int, sample_every: int, save_every: int, work_dir: Path, layers: int = 2, hidden: int = 64,
         keep_samples: int = 20) -> dict:
    import torch

    import runtime
    from planner.specs.plan import Plan
    from runtime.ckpt import Checkpointer
    from runtime.gpt import GPT, GPTConfig, init_weights
    from runtime.launch import batch_for

    hardware = json.loads((ROOT / "data" / "hardware" / "cpu-dev-2core.json").read_text())
    swap_root = work_dir / "swap"
    swap_root.mkdir()
    plan = Plan.from_dict({
        "model": {"num_layers": layers, "hidden_size": hidden, "num_heads": 4, "seq_len": 32, "vocab_size": 256},
        "hardware": hardware, "num_gpus": 1, "precision": "fp32", "recompute_interval": 1, "micro_batch_per_gpu": 2,
        "placement": {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"},
        "nvme_path": str(swap_root), "optimizer_chunk_bytes": 64 * 1024, "num_optimizer_buffers": 3})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.from_model_spec(plan.model))
    model = runtime.shard(model, plan, param_init_fn=init_weights)
    state = runtime.state_of(model)
    # The profiler keeps the last MAX_SAMPLES (10,000) step samples, ~2 KB each; a smaller bound lets
    # this run reach it, so that what is measured is the steady state of a run of any length.
    state.profiler.keep_samples(keep_samples)
    optimizer = runtime.AdamW(model, lr=1e-3)
    checkpoints = Checkpointer(work_dir / "ck", plan=plan, seed=0, rank=0, world_size=1, resume=False, keep=2)
    samples, losses = [], []
    for step in range(1, steps + 1):
        batch = batch_for(step, 0, plan, 256, None, 0)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % save_every == 0:
            checkpoints.save(step, state, optimizer, scalars={"loss_scaler": None, "num_skipped_steps": 0})
        if step % sample_every == 0:
            samples.append(sample(step, swap_root))
    optimizer.close()
    state.close()
    return {"samples": samples, "losses": losses, "num_params": sum(u.layout.numel for u in state.units),
            "swap_dirs_left": len(list(swap_root.iterdir()))}


def growth(samples: list[dict[str, int]], warmup_step: int) -> dict[str, int]:
    """Rise of each quantity after the warm-up: the second half's maximum over the first half's (a
    thread pool that starts a worker late is bounded; a leak rises in every half), 0 or less when
    nothing grew. Needs 4+ samples after the warm-up."""
    after = [s for s in samples if s["step"] >= warmup_step]
    assert len(after) >= 4, "too few samples after the warm-up"
    first, second = after[: len(after) // 2], after[len(after) // 2 :]
    return {k: max(s[k] for s in second) - max(s[k] for s in first) for k in after[0]
            if k not in ("step", "io_uring_kernel_workers")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sample-every", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--rss-tolerance-mib", type=float, default=1.0)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    import results_md  # benchmarks/ is on sys.path when a script runs

    machine = results_md.measure_machine(torch=True, disk=tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="tierwise-soak-") as tmp:
        result = soak(steps=args.steps, sample_every=args.sample_every, save_every=args.save_every, work_dir=Path(tmp))
    grew = growth(result["samples"], warmup_step=args.save_every)
    ok = (all(grew[k] <= 0 for k in ("open_fds", "threads", "swap_apparent_bytes", "swap_allocated_bytes"))
          and grew["rss_bytes"] <= args.rss_tolerance_mib * MIB and result["swap_dirs_left"] == 0)
    doc = {"steps": args.steps, "sample_every": args.sample_every, "save_every": args.save_every,
           "num_params": result["num_params"], "growth_after_warmup": grew, "passed": ok,
           "first_sample": result["samples"][0], "last_sample": result["samples"][-1],
           "loss_first_last": [result["losses"][0], result["losses"][-1]],
           "machine": machine.finish().to_dict()}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        rows = ["| step | RSS MiB | anon RSS MiB | open fds | threads | swap files MiB (apparent / allocated) |",
                "|---:|---:|---:|---:|---:|---:|"]
        for s in result["samples"]:
            rows.append(f"| {s['step']} | {s['rss_bytes'] / MIB:.1f} | {s['anon_rss_bytes'] / MIB:.1f} | {s['open_fds']} | "
                        f"{s['threads']} | {s['swap_apparent_bytes'] / MIB:.2f} / {s['swap_allocated_bytes'] / MIB:.2f} |")
        body = "\n".join([
            "## Soak: NVMe placement with checkpoints, nothing grows",
            "",
            f"`python benchmarks/soak.py --steps {args.steps} --sample-every {args.sample_every} --save-every "
            f"{args.save_every} --write-results`. {machine.describe()}",
            "",
            f"GPT of {result['num_params']:,} parameters, "
            "params, gradients and optimizer states on NVMe (swap files in the disk named above), a checkpoint every "
            f"{args.save_every} steps (keep 2), one torch thread, the profiler keeping its last 20 step samples. Growth "
            f"(max over the second half of the samples after step {args.save_every} minus max over the first half): "
            f"RSS {grew['rss_bytes'] / MIB:+.2f} MiB, anonymous RSS {grew['anon_rss_bytes'] / MIB:+.2f} MiB, open fds "
            f"{grew['open_fds']:+d}, threads {grew['threads']:+d}, swap files {grew['swap_apparent_bytes']:+d} bytes "
            f"apparent / {grew['swap_allocated_bytes']:+d} allocated; loss {result['losses'][0]:.3f} -> "
            f"{result['losses'][-1]:.3f}; verdict: {'no growth' if ok else 'GROWTH'}.",
            "",
            *rows,
        ])
        results_md.write_section("soak", body)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
