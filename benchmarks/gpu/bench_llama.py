"""The offload tiers on a real transformer: the kit's Llama (benchmarks/gpu/llama-1b.json) in bf16, ours
against FSDP2 and DeepSpeed at their best, side by side in one process on the one GPU.

    python benchmarks/gpu/bench_llama.py offload [--profile gpu|dry] [--require-prebuilt] [--out offload.json]
    python benchmarks/gpu/bench_llama.py nvme --nvme-path DIR [--profile gpu|dry] [--require-prebuilt]
                                              [--ds-aio 128,1 | --sweep] [--out nvme.json]

The model is TinyLlama-1.1B's shape (22 layers, hidden 2048, SwiGLU 5632, 32 heads with 4 KV heads,
vocabulary 32000, untied; 1.10 B parameters) as a Hugging Face config, built with transformers in
fp32 and trained in bf16, at the shapes of SIZINGS (tokens per step equal at both sequence lengths).
`nvme` cuts it to its first 4 layers (0.31 B parameters): a full-NVMe step of the 1.1 B model moves
about 40 GB, minutes per system on the machines the kit runs on. Every system starts from the same
weights (one seeded model, copied) and trains on the same batch; systems alternate step by step
(the order flips every step) after `warmup` steps; medians and the median of paired ratios are
reported after each shape, as they are measured ([Note: results survive a cut] in call.py).

The systems compared, and the NVMe roofline: [Note: the systems compared], above `OURS`.

`--profile dry` runs the same code on the CPU at a few thousand parameters: the emulated device
(`CopyEngine.separate_memory_on_cpu`), FSDP2 and DeepSpeed on the host (`run.sh --dry-run`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[2]
KIT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
import report  # noqa: E402
from kit import emit  # noqa: E402

CONFIG = KIT / "llama-1b.json"
LR = 1e-4


class Shape(NamedTuple):
    seq: int
    batch: int


class Sizing(NamedTuple):
    overrides: dict[str, Any]
    """Changes to CONFIG (the dry run's few-thousand-parameter model, the NVMe stage's 4 layers)."""
    shapes: tuple[Shape, ...]
    """In run order: the first one is what the must-shows are read at."""
    warmup: int
    steps: int
    hardware: str
    """The preset the plans are fitted on (it chooses the plans' knobs; the placement is pinned)."""


TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}
SIZINGS = {
    ("offload", "gpu"): Sizing({}, (Shape(4096, 4), Shape(2048, 8)), 2, 3, "h200-x1"),
    ("nvme", "gpu"): Sizing({"num_hidden_layers": 4}, (Shape(4096, 1), Shape(2048, 2)), 1, 2, "h200-x1"),
    ("offload", "dry"): Sizing(TINY, (Shape(128, 2), Shape(64, 4)), 1, 2, "cpu-dev-2core"),
    ("nvme", "dry"): Sizing(TINY, (Shape(128, 1), Shape(64, 2)), 1, 2, "cpu-dev-2core"),
}
"""(mode, profile) -> what runs. 16 Ki tokens a step on the GPU: the host tier's CPU Adam over 1.1 B
parameters (about 0.3-0.5 s) against about 0.4 s of GPU work, the regime the all-on-GPU must-show is about."""

TIERS = ("params", "gradients", "optimizer_states", "recompute_inputs")
HOST = dict.fromkeys(TIERS, "cpu")
DEVICE = dict.fromkeys(TIERS, "gpu")
NVME = {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"}
# [Note: the systems compared] Systems (`offload`: the host-memory tier, its baselines and all-on-GPU; `nvme`: the NVMe tier):
# - `ours-*`: `runtime.shard` executing a plan `planner fit` makes for the pinned placement of OURS
#   (the table is the place to add a plan option to compare, e.g. a host pinning mode); `ours-cpu` keeps
#   a bf16 parameter shard beside the fp32 master (`host_param_shard: compute_copy`), `ours-cpu-master`
#   reads the master itself and casts on the GPU (`host_param_shard: master`), whichever `fit` chose;
# - `fsdp2-cpu`: `fully_shard` per decoder layer and at the root, `CPUOffloadPolicy(pin_memory=True)`,
#   `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, `torch.optim.AdamW(fused=True)` on its
#   CPU shards (foreach where fused refuses them; the JSON says which);
# - `deepspeed-cpu`: ZeRO-3 with `offload_param` and `offload_optimizer` on CPU, pinned, `overlap_comm`,
#   bf16, DeepSpeedCPUAdam (prebuilt by the build stage);
# - `deepspeed-nvme`: ZeRO-Infinity, both offloads on NVMe, pinned, optimizer swapping pipelined, aio at
#   queue depth 128 x 1 thread (`--ds-aio`; `--sweep` tries 16/64/128 x 1/4/8 first and keeps the fastest);
# - `plain`: torch, fp32 parameters, bf16 autocast, fused AdamW, all on the GPU.
# No system checkpoints activations (the plans' recompute interval 0). The step's NVMe roofline
# ([Note: the I/O roofline] in benchmarks/bench_nvme_step.py): our step's bytes read and written on NVMe
# (the runtime's link counters) over the rates of a probe of the same read/write mix through the same
# engine, run right after each measured step, and over the rates `planner probe` measures
# (`runtime.probe.measure_nvme`).
OURS = {
    "ours-cpu": {"placement": HOST, "host_param_shard": "compute_copy"},
    # The fp32 master as the host parameter shard (planner/specs/plan.py `HostParamShard`): no cast on
    # the optimizer's thread, twice the bytes over the link, cast on the GPU (as FSDP2's CPU offload).
    "ours-cpu-master": {"placement": HOST, "host_param_shard": "master"},
    "ours-gpu": {"placement": DEVICE},
    "ours-nvme": {"placement": NVME},
}
"""Our systems -> the plan: its pinned placement and any option set on the fitted plan. A variant is
one line (e.g. `"ours-cpu-staged": {"placement": HOST, "host_pinning": "staged"}`) and one name in MODES."""
MODES = {"offload": ("ours-cpu", "ours-cpu-master", "ours-gpu", "fsdp2-cpu", "deepspeed-cpu", "plain"), "nvme": ("ours-nvme", "deepspeed-nvme")}
"""Mode -> its systems; ours first (built before any process group exists, as under `planner run`)."""
BOTH_GPU_COPIES_MIN_BYTES = 100 * 2**30
"""GPU memory under which `offload` leaves `ours-gpu` out: beside plain torch's all-on-GPU copy (about
18 GB with its fp32 Adam states) and one step's activations and logits at 16 Ki tokens (about 30 GB,
measured per token on this Llama), a second all-on-GPU copy (about 20 GB) leaves an 80 GB H100 too
little room; plain torch is then the all-on-GPU reference. An H200 runs both."""
DS_AIO = (128, 1)
"""DeepSpeed's aio (queue depth, intra_op_parallelism threads): the fastest of the CPU VM's sweep."""
DS_SWEEP = tuple((q, t) for q in (16, 64, 128) for t in (1, 4, 8))


def model_config(overrides: dict[str, Any]) -> dict[str, Any]:
    return {**json.loads(CONFIG.read_text()), **overrides}


def reference_model(config: dict[str, Any]) -> torch.nn.Module:
    """The weights every system starts from: transformers' own init, seeded, fp32, on the host."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields), dtype=torch.float32)


class CopyFrom:
    """A `param_init_fn` for `runtime.shard`: each module's parameters from the reference model's."""

    def __init__(self, model: torch.nn.Module, source: torch.nn.Module) -> None:
        self.prefix = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.source = dict(source.named_parameters(remove_duplicate=False))

    def __call__(self, module: torch.nn.Module) -> None:
        prefix = self.prefix[id(module)]
        for attr, p in module._parameters.items():
            name = f"{prefix}.{attr}" if prefix else attr
            if p is not None and p.shape == self.source[name].shape:  # a tied copy's shard is 0 elements
                p.copy_(self.source[name])


def fitted_plan(system: str, config_path: Path, shape: Shape, sizing: Sizing, nvme_path: str | None) -> dict:
    """`planner fit` for the system's pinned placement (OURS), no activation checkpoints, bf16; then
    the system's own options over the fitted plan."""
    options = dict(OURS[system])
    placement = options.pop("placement")
    out = Path(os.environ.get("GPUKIT_WORK", "/tmp")) / f"plan-{system}.json"
    cmd = [sys.executable, "-m", "tierwise", "fit", str(config_path), "--seq", str(shape.seq), "--batch-per-gpu",
           str(shape.batch), "--gpus", "1", "--hardware", sizing.hardware, "--precision", "bf16",
           "--recompute-interval", "0", "--placement", ",".join(f"{k}={v}" for k, v in placement.items()),
           "--out", str(out)]
    if nvme_path:
        cmd += ["--nvme-path", nvme_path]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode or not out.exists():
        raise RuntimeError(f"planner fit for {system}: {(proc.stderr or proc.stdout).strip()[-800:]}")
    return {**json.loads(out.read_text()), **options}


def ensure_process_group(device: torch.device) -> None:
    """World 1 for FSDP2 and DeepSpeed: gloo for host tensors, NCCL for CUDA ones."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("BENCH_PORT", "29651"))
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def loss_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    from runtime.hf_model import causal_lm_loss

    return causal_lm_loss(model, tokens)


def ours(system: str, config: dict, config_path: Path, reference: torch.nn.Module, shape: Shape, sizing: Sizing,
         nvme_path: str | None):  # noqa: ANN201 - a step callable
    import runtime
    from runtime import hf_model

    model = hf_model.build_model(config)
    plan = fitted_plan(system, config_path, shape, sizing, nvme_path if system == "ours-nvme" else None)
    model = runtime.shard(model, plan, param_init_fn=CopyFrom(model, reference))
    state = runtime.state_of(model)
    opt = runtime.AdamW(model, lr=LR, weight_decay=0.0)
    links = state.profiler.link_bytes

    def step(tokens: torch.Tensor) -> float:
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        state.wait_io()  # I/O the step left in flight is the step's ([Note: blocks of steps])
        return value

    step.optimizer = "runtime.AdamW"
    step.nvme_bytes = lambda: (links.get("nvme_read", 0), links.get("nvme_write", 0))
    step.plan = {k: plan.get(k) for k in ("placement", "prefetch_depth", "tiling_factor", "optimizer_chunk_bytes",
                                          "num_optimizer_buffers", "optimizer_step")}
    return step


def fsdp2(reference: torch.nn.Module, device: torch.device):  # noqa: ANN201
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    ensure_process_group(device)
    model = copy.deepcopy(reference)
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    state = {"opt": torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True), "kind": "fused"}

    def step(tokens: torch.Tensor) -> float:
        loss = loss_of(model, tokens)
        loss.backward()
        try:
            state["opt"].step()
        except (RuntimeError, NotImplementedError):  # fused AdamW refusing these CPU DTensors
            if state["kind"] != "fused":
                raise
            state.update(opt=torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=True), kind="foreach")
            state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)
        step.optimizer = f"torch AdamW {state['kind']} (CPU shards)"
        return loss.item()

    step.optimizer = "torch AdamW fused (CPU shards)"
    return step


def deepspeed_config(shape: Shape, offload: dict, aio: tuple[int, int] | None) -> dict:
    """ZeRO-3 at its best for this comparison: bf16, DeepSpeedCPUAdam (an offloaded AdamW without
    `torch_adam`), pinned offload, overlap_comm; on NVMe pipelined optimizer swapping and the aio setting."""
    optimizer_offload = {**offload, "pipeline_read": True, "pipeline_write": True} if offload["device"] == "nvme" else offload
    doc = {"train_micro_batch_size_per_gpu": shape.batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
           "bf16": {"enabled": True}, "fp16": {"enabled": False},
           "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                 "offload_param": offload, "offload_optimizer": optimizer_offload}}
    if aio is not None:
        doc["aio"] = {"block_size": 1 << 20, "queue_depth": aio[0], "intra_op_parallelism": aio[1],
                      "single_submit": False, "overlap_events": True}
    return doc


def deepspeed(reference: torch.nn.Module, device: torch.device, shape: Shape, nvme_path: str | None,
              aio: tuple[int, int]):  # noqa: ANN201
    if device.type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported
    ensure_process_group(device)
    import deepspeed as ds

    pinned = device.type == "cuda"
    if nvme_path is None:
        config = deepspeed_config(shape, {"device": "cpu", "pin_memory": pinned}, None)
    else:
        swap = Path(nvme_path, f"deepspeed-qd{aio[0]}-t{aio[1]}")
        swap.mkdir(parents=True, exist_ok=True)
        config = deepspeed_config(shape, {"device": "nvme", "nvme_path": str(swap), "pin_memory": pinned}, aio)
    model = copy.deepcopy(reference).to(device)
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(tokens: torch.Tensor) -> float:
        loss = loss_of(engine, tokens)
        engine.backward(loss)
        engine.step()
        return loss.item()

    step.optimizer = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
    step.config = config
    return step


def plain(reference: torch.nn.Module, device: torch.device):  # noqa: ANN201
    model = copy.deepcopy(reference).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)

    def step(tokens: torch.Tensor) -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    step.optimizer = f"torch AdamW fused ({device.type}), bf16 autocast"
    return step


def build_systems(names: list[str], sizing: Sizing, device: torch.device, nvme_path: str | None,
                  aio: tuple[int, int], work: Path) -> tuple[dict, dict]:
    """name -> step callable, for every system that could be built; name -> error for the others."""
    config = model_config(sizing.overrides)
    config_path = work / f"model-{len(config)}-{config['num_hidden_layers']}x{config['hidden_size']}.json"
    config_path.write_text(json.dumps(config, indent=2))
    reference = reference_model(config)
    steps, errors = {}, {}
    for name in names:
        try:
            if name in OURS:
                steps[name] = ours(name, config, config_path, reference, sizing.shapes[0], sizing, nvme_path)
            elif name == "fsdp2-cpu":
                steps[name] = fsdp2(reference, device)
            elif name.startswith("deepspeed-"):
                steps[name] = deepspeed(reference, device, sizing.shapes[0], nvme_path if name.endswith("nvme") else None,
                                        aio)
            elif name == "plain":
                steps[name] = plain(reference, device)
            else:
                raise SystemExit(f"unknown system {name!r}: use one of {sorted(set(OURS) | {'fsdp2-cpu', 'plain'})}")
        except Exception as exc:  # one system's failure is reported by name; the others are measured
            errors[name] = f"{type(exc).__name__}: {exc}"[-1500:]
    return steps, errors


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(step: Any, tokens: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(loss, seconds) of one step, the device idle before and after it."""
    synchronize(device)
    start = time.perf_counter()
    loss = step(tokens)
    synchronize(device)
    return loss, time.perf_counter() - start


def measure_shape(steps: dict, shape: Shape, sizing: Sizing, device: torch.device, vocab: int,
                  probe: Any = None) -> dict:
    """`warmup + steps` rounds of every system in alternating order on one batch of `shape`. A system
    whose step fails (out of memory, say) is dropped, named with its error; the others go on."""
    g = torch.Generator().manual_seed(shape.seq * 7 + shape.batch)
    tokens = torch.randint(0, vocab, (shape.batch, shape.seq + 1), generator=g).to(device)
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    failed: dict[str, str] = {}
    nvme_bytes: list[tuple[int, int]] = []
    rooflines: list[dict] = []
    for i in range(sizing.warmup + sizing.steps):
        for name in [n for n in (names if i % 2 == 0 else reversed(names)) if n not in failed]:
            counter = getattr(steps[name], "nvme_bytes", None)
            before = counter() if counter else None
            try:
                loss, elapsed = timed_step(steps[name], tokens, device)
            except Exception as exc:  # one system's failure is reported by name; the others are measured
                failed[name] = f"{type(exc).__name__}: {exc}"[-1500:]
                times[name] = []
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            losses[name].append(loss)
            if i < sizing.warmup:
                continue
            times[name].append(elapsed)
            if counter and probe is not None:
                after = counter()
                nvme_bytes.append((after[0] - before[0], after[1] - before[1]))
                rooflines.append(probe(*nvme_bytes[-1]))  # the adjacent roofline of this step's own mix
    return {"seq": shape.seq, "batch": shape.batch, "tokens_per_step": shape.seq * shape.batch, "failed": failed,
            "step_time_s": times, "losses": losses, "nvme_bytes_per_step": nvme_bytes, "adjacent_rooflines": rooflines}


def paired(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def summarise(raw: dict, optimizers: dict[str, str], rates: dict | None = None) -> dict:
    """Per system: median and minimum step, tokens per second; the ratios the must-shows read."""
    times = raw["step_time_s"]
    summary = {n: {"median_step_time_s": statistics.median(t), "min_step_time_s": min(t), "step_times_s": t,
                   "tokens_per_s": raw["tokens_per_step"] / statistics.median(t), "first_losses": raw["losses"][n][:3],
                   "optimizer": optimizers.get(n)} for n, t in times.items() if t}
    ratios: dict[str, float] = {}
    for ours_name, others in (("ours-cpu", ("fsdp2-cpu", "deepspeed-cpu", "ours-gpu", "plain")),
                              ("ours-cpu-master", ("ours-cpu", "fsdp2-cpu", "deepspeed-cpu")),
                              ("ours-nvme", ("deepspeed-nvme",)), ("ours-gpu", ("plain",))):
        for other in others:
            if ours_name in summary and other in summary:
                ratios[report.RATIO.format(ours_name, other)] = paired(times, ours_name, other)
    gpu = [summary[n]["tokens_per_s"] for n in ("ours-gpu", "plain") if n in summary]
    if "ours-cpu" in summary and gpu:
        ratios[report.GPU_SHARE] = summary["ours-cpu"]["tokens_per_s"] / max(gpu)
    doc = {k: raw[k] for k in ("seq", "batch", "tokens_per_step", "failed")} | {"summary": summary, "ratios": ratios}
    if raw["adjacent_rooflines"] and summary.get("ours-nvme"):
        doc |= roofline_summary(raw, times["ours-nvme"], rates)
    return doc


def roofline_summary(raw: dict, ours_times: list[float], rates: dict | None) -> dict:
    """Our step over its NVMe roofline: per measured step, over the adjacent probe of its own mix
    (the must-show's), and over its bytes at the rates measured before the systems were built."""
    adjacent = [t / r["roofline_s"] for t, r in zip(ours_times, raw["adjacent_rooflines"], strict=True)]
    read, write = raw["nvme_bytes_per_step"][-1]
    doc = {"nvme_bytes_per_step": {"read": read, "write": write}, "adjacent_rooflines": raw["adjacent_rooflines"],
           report.ROOFLINE: {"median": statistics.median(adjacent), "all": adjacent}}
    if rates:
        serial_s = read / rates["read_bytes_per_s"] + write / rates["write_bytes_per_s"]
        doc[report.PROBED_ROOFLINE] = {"roofline_s": serial_s, "median": statistics.median(ours_times) / serial_s}
    return doc


def deadline_left_s() -> float:
    raw = os.environ.get("GPUKIT_DEADLINE")
    return float(raw) - time.time() if raw else float("inf")


def publish(doc: dict, out: Path | None, stage: str) -> None:
    """The document so far into WORK (`out`) and into the call's results ([Note: results survive a cut])."""
    if out:
        out.write_text(json.dumps(doc, indent=2))
    if os.environ.get("GPUKIT_OUT"):
        report.publish(Path(os.environ["GPUKIT_OUT"]), stage, doc)


DEEPSPEED_OPS = {"deepspeed-cpu": ("cpu_adam",), "deepspeed-nvme": ("cpu_adam", "async_io", "pin_memory")}
"""DeepSpeed system -> the ops it loads (DeepSpeedCPUAdam; ZeRO-Infinity's swapper adds async_io,
which loads pin_memory).

[Note: DeepSpeed's ops are the build stage's]
The build stage is the one place DeepSpeed's ops are compiled (benchmarks/gpu/build_ops.py). With
`--require-prebuilt` (every GPU run) a stage never compiles one: a DeepSpeed system whose ops are not
prebuilt in the DeepSpeed it imports (`installed_ops`), or a DeepSpeed that does not import, is left
out by name with the reason (`left_out` in the JSON, "not measured" in the must-shows), DeepSpeed's JIT
build is disabled in the process (an op it would still compile fails that system by name, within
seconds), and every other system, ours first, is measured as if it were not there: a baseline's
absence never stops our own measurement, and no measured stage spends its time compiling
(docs/notes/2026-11-28-h200-offload-tiers.md: the NVMe tier unmeasured while DeepSpeed lacked its ops)."""


def deepspeed_left_out(names: list[str], require_prebuilt: bool) -> dict[str, str]:
    """DeepSpeed system -> why it is not measured here ([Note: DeepSpeed's ops are the build stage's]):
    DeepSpeed does not import, or (with `require_prebuilt`) an op it loads is not prebuilt."""
    wanted = [n for n in names if n in DEEPSPEED_OPS]
    if not wanted:
        return {}
    try:
        import deepspeed  # noqa: F401
        from deepspeed.git_version_info import installed_ops
    except ImportError as exc:
        return dict.fromkeys(wanted, f"not measured: DeepSpeed does not import ({exc}); the install stage installs it")
    out = {}
    for name in wanted:
        unbuilt = [op for op in DEEPSPEED_OPS[name] if not installed_ops.get(op)] if require_prebuilt else []
        if unbuilt:
            out[name] = (f"not measured: DeepSpeed's {', '.join(unbuilt)} op(s) are not prebuilt and only the build stage "
                         "compiles them (its result in build says why it did not; a later call carries the wheel a "
                         "build returned: gather_wheels.sh --built)")
    return out


def forbid_jit_builds() -> None:
    """DeepSpeed's JIT build disabled in this process: an op that is not prebuilt fails its system by
    name instead of compiling for minutes inside a measured stage."""
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:
        return

    def refuse(self, verbose: bool = True):  # noqa: ANN202, ARG001 - OpBuilder.jit_load's signature
        raise RuntimeError(f"DeepSpeed would JIT-build its {self.name} op here: only the build stage compiles ops")

    OpBuilder.jit_load = refuse


def nvme_refusal() -> str | None:
    """Why our NVMe tier cannot be measured here, or None: it needs the runtime's C++ engine; a run on
    the Python engine (runtime/nvme/pyengine.py) would time a slow path the project does not ship for
    speed. DeepSpeed's absence is no reason ([Note: DeepSpeed's ops are the build stage's])."""
    from runtime.nvme import EngineConfig, IOEngine
    from runtime.nvme.engine import extension_available

    if not extension_available():
        return ("nvme: runtime._aio_ext is not built, so the NVMe tier would run on the Python I/O engine "
                "(runtime/nvme/pyengine.py): run the build stage")
    backend = IOEngine(EngineConfig()).backend
    if backend == "python":
        return "nvme: the runtime's I/O engine resolved to the Python engine; the kit times the C++ one only"
    return None


class AdjacentProbe:
    """The step's own read/write mix through the runtime's engine, scaled to about `probe_bytes` in all
    (MixProbe of benchmarks/bench_nvme_step.py; its rates make the roofline of the full step's bytes)."""

    def __init__(self, nvme_path: str, probe_bytes: int) -> None:
        self.nvme_path, self.probe_bytes, self._probe = nvme_path, probe_bytes, None

    def __call__(self, read_bytes: int, write_bytes: int) -> dict:
        from bench_nvme_step import MixProbe

        if self._probe is None:
            scale = min(1.0, self.probe_bytes / max(read_bytes + write_bytes, 1))
            self._probe = MixProbe(self.nvme_path, int(read_bytes * scale), int(write_bytes * scale))
        return self._probe.roofline_s(read_bytes, write_bytes, self._probe.time())

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()


def measure(mode: str, args: argparse.Namespace, device: torch.device, aio: tuple[int, int]) -> dict:
    """Build the mode's systems, then every shape of its sizing while the stage has time for it,
    publishing the document after each."""
    sizing = SIZINGS[(mode, args.profile)]
    names = [n for n in (args.systems.split(",") if args.systems else MODES[mode])]
    work = Path(os.environ.get("GPUKIT_WORK", "/tmp"))
    left_out = deepspeed_left_out(names, args.require_prebuilt)
    names = [n for n in names if n not in left_out]
    if device.type == "cuda" and "ours-gpu" in names and "plain" in names and (
            torch.cuda.get_device_properties(device).total_memory < BOTH_GPU_COPIES_MIN_BYTES):
        names.remove("ours-gpu")
        left_out["ours-gpu"] = (f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB of GPU memory "
                                "holds one all-on-GPU copy beside a step's activations, not two (plain torch stays)")
    doc: dict = {"benchmark": f"gpu {mode}", "mode": mode, "profile": args.profile, "device": str(device),
                 "model": describe_model(sizing), "warmup_steps": sizing.warmup, "measured_steps": sizing.steps,
                 "systems": names, "left_out": left_out, "shapes": {}, "skipped_shapes": [], "ok": False, "partial": True}
    if mode == "nvme":
        from runtime.probe import measure_nvme

        rates = measure_nvme(args.nvme_path)
        doc["nvme_probe"] = {"read_bytes_per_s": rates.read_bytes_per_s, "write_bytes_per_s": rates.write_bytes_per_s,
                             "direct": rates.direct, "backend": rates.backend}
    start = time.perf_counter()
    steps, doc["build_errors"] = build_systems(names, sizing, device, args.nvme_path if mode == "nvme" else None, aio, work)
    doc["build_s"] = round(time.perf_counter() - start, 1)
    doc["plans"] = {n: getattr(s, "plan", None) for n, s in steps.items() if n in OURS}
    doc["deepspeed_config"] = next((s.config for n, s in steps.items() if n.startswith("deepspeed-")), None)
    publish(doc, args.out, mode)
    probe = AdjacentProbe(args.nvme_path, args.probe_bytes) if mode == "nvme" and "ours-nvme" in steps else None
    optimizers = {n: getattr(s, "optimizer", None) for n, s in steps.items()}
    last_s = 0.0
    try:
        for shape in sizing.shapes:
            if doc["shapes"] and last_s * 1.1 > deadline_left_s():
                doc["skipped_shapes"].append(f"{shape.seq}x{shape.batch}")
                continue
            began = time.perf_counter()
            raw = measure_shape(steps, shape, sizing, device, int(model_config(sizing.overrides)["vocab_size"]), probe)
            doc["shapes"][f"seq {shape.seq} x batch {shape.batch}"] = summarise(raw, optimizers, doc.get("nvme_probe"))
            last_s = time.perf_counter() - began
            publish(doc, args.out, mode)
    finally:
        if probe is not None:
            probe.close()
    failed = any(shape["failed"] for shape in doc["shapes"].values())
    doc |= {"ok": not doc["build_errors"] and not failed and bool(doc["shapes"]), "partial": bool(doc["skipped_shapes"])}
    return doc


def describe_model(sizing: Sizing) -> str:
    cfg = model_config(sizing.overrides)
    return (f"Llama ({CONFIG.name}{' with ' + json.dumps(sizing.overrides) if sizing.overrides else ''}): "
            f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, SwiGLU {cfg['intermediate_size']}, "
            f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV, vocabulary {cfg['vocab_size']}; bf16")


def sweep(args: argparse.Namespace) -> tuple[tuple[int, int], list[dict]]:
    """DeepSpeed's NVMe step alone at each aio setting of DS_SWEEP (each in its own process, the first
    shape, one measured step after the warm-up); the fastest setting and every point."""
    points = []
    for queue_depth, threads in DS_SWEEP:
        out = Path(os.environ.get("GPUKIT_WORK", "/tmp")) / f"sweep-qd{queue_depth}-t{threads}.json"
        cmd = [sys.executable, __file__, "nvme", "--profile", args.profile, "--nvme-path", args.nvme_path,
               "--systems", "deepspeed-nvme", "--ds-aio", f"{queue_depth},{threads}", "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "GPUKIT_OUT"}  # a point is not the stage's result
        subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        try:
            first = next(iter(json.loads(out.read_text())["shapes"].values()))
            points.append({"queue_depth": queue_depth, "threads": threads,
                           "median_step_time_s": first["summary"]["deepspeed-nvme"]["median_step_time_s"]})
        except (OSError, StopIteration, KeyError, json.JSONDecodeError) as exc:
            points.append({"queue_depth": queue_depth, "threads": threads, "error": f"{type(exc).__name__}: {exc}"})
    ran = [p for p in points if "error" not in p]
    best = min(ran, key=lambda p: p["median_step_time_s"]) if ran else {"queue_depth": DS_AIO[0], "threads": DS_AIO[1]}
    return (best["queue_depth"], best["threads"]), points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=sorted({m for m, _ in SIZINGS}))
    ap.add_argument("--profile", choices=("gpu", "dry"), default="gpu")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--systems", default=None, help="a comma list instead of the mode's systems")
    ap.add_argument("--ds-aio", default=f"{DS_AIO[0]},{DS_AIO[1]}", help="DeepSpeed's aio queue depth,threads")
    ap.add_argument("--sweep", action="store_true", help="sweep DeepSpeed's aio settings first, keep the fastest")
    ap.add_argument("--require-prebuilt", action="store_true", help="refuse DeepSpeed ops that would JIT-build")
    ap.add_argument("--probe-bytes", type=int, default=2 << 30, help="bytes each adjacent roofline probe moves")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from runtime.host_malloc import keep_freed_memory_mapped

    keep_freed_memory_mapped()  # as `planner run` does for a rank; process-wide, so every system gets it
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        from runtime.transfer.stores import CopyEngine

        CopyEngine.separate_memory_on_cpu = True  # the emulated device: host tiers cross a "link"
        os.environ["DS_ACCELERATOR"] = "cpu"
    if args.mode == "nvme":
        if not args.nvme_path:
            raise SystemExit("bench_llama.py nvme: --nvme-path DIR is required (a directory on the NVMe drive)")
        refusal = nvme_refusal()
        if refusal:
            return emit({"ok": False, "error": refusal, "mode": "nvme"}, args.out)
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    if args.require_prebuilt:
        forbid_jit_builds()
    aio = tuple(int(v) for v in args.ds_aio.split(","))
    points = None
    if args.sweep and not deepspeed_left_out(["deepspeed-nvme"], args.require_prebuilt):
        aio, points = sweep(args)
    doc = measure(args.mode, args, device, aio)
    if args.mode == "nvme":
        doc["deepspeed_aio"] = {"queue_depth": aio[0], "threads": aio[1], "swept": points}
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
