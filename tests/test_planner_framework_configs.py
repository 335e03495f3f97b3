"""Framework configs beyond DeepSpeed: an accelerate (FSDP2) config and a `fully_shard` snippet
(planner/output/framework_configs.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from planner.output.framework_configs import accelerate_config, accelerate_yaml, fsdp2_refusal, fsdp2_snippet
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.plan import Placement, Plan, strategy_named

CPU_OFFLOAD = Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu")


def plan(strategy="zero-inf-cpu", **changes):
    fields = dict(model=resolve_model("1.4B"), node=resolve_hardware("dgx-h100"), num_gpus=16, strategy=strategy,
                  placement=strategy_named(strategy).placement if strategy != "custom" else CPU_OFFLOAD,
                  micro_batch_per_gpu=4, recompute_interval=1)
    return Plan(**(fields | changes))


def test_cpu_offload_plan_as_accelerate_yaml():
    text = accelerate_yaml(plan())
    assert text.startswith("# accelerate config for: ")
    doc = yaml.safe_load(text)
    assert doc["distributed_type"] == "FSDP" and doc["mixed_precision"] == "bf16"
    assert (doc["num_processes"], doc["num_machines"], doc["machine_rank"]) == (16, 2, 0)
    assert doc["fsdp_config"] == {
        "fsdp_version": 2,
        "fsdp_offload_params": True,
        "fsdp_reshard_after_forward": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": True,
        "fsdp_activation_checkpointing_offload": True,
    }
    assert "main_process_ip" in text  # two machines: the header says what to fill in


def test_accelerate_maps_each_expressible_strategy():
    zero2 = accelerate_config(plan("zero2", recompute_interval=0, precision="fp32", num_gpus=8))
    assert zero2["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert zero2["fsdp_config"]["fsdp_offload_params"] is False
    assert zero2["fsdp_config"]["fsdp_activation_checkpointing"] is False
    assert "fsdp_activation_checkpointing_offload" not in zero2["fsdp_config"]
    assert (zero2["mixed_precision"], zero2["num_machines"]) == ("no", 1)
    dp = accelerate_config(plan("dp", num_gpus=8, precision="fp16"))
    assert dp["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in dp and dp["mixed_precision"] == "fp16"
    assert accelerate_config(plan("dp", num_gpus=1))["distributed_type"] == "NO"


@pytest.mark.parametrize(
    ("changes", "named", "way_out"),
    [
        (dict(strategy="zero-inf-nvme", placement=strategy_named("zero-inf-nvme").placement, nvme_path="/nvme"),
         "NVMe placement (params=nvme, gradients=nvme, optimizer_states=nvme)", "use --deepspeed-config"),
        (dict(strategy="zero-offload", placement=strategy_named("zero-offload").placement),
         "params=gpu, gradients=cpu, optimizer_states=cpu", "use --deepspeed-config"),
        (dict(tiling_factor=4), "tiling (tiling_factor 4)", "pin --tiling-factor 1"),
        (dict(model_parallel_degree=4, micro_batch_per_gpu=1), "tensor parallelism (model_parallel_degree 4)",
         "pin --model-parallel 1"),
    ],
)
def test_plans_fsdp2_cannot_express_are_refused_in_one_line(changes, named, way_out):
    refused = plan(**changes)
    assert named in fsdp2_refusal(refused)
    for write_config in (accelerate_config, fsdp2_snippet):
        with pytest.raises(PlannerError) as info:
            write_config(refused)
        message = str(info.value)
        assert "\n" not in message and named in message and way_out in message


def test_snippet_refuses_what_only_accelerate_expresses():
    with pytest.raises(PlannerError, match="DistributedDataParallel, not fully_shard; use --accelerate-config"):
        fsdp2_snippet(plan("dp", num_gpus=8))
    with pytest.raises(PlannerError, match="fp16 needs a loss scaler"):
        fsdp2_snippet(plan("zero3", precision="fp16"))


@pytest.mark.parametrize("strategy", ["zero-inf-cpu", "zero3", "zero2"])
def test_snippet_compiles(strategy):
    source = fsdp2_snippet(plan(strategy, num_gpus=8))
    compile(source, "snippet.py", "exec")
    assert ("offload_wrapper(block)" in source) == (strategy == "zero-inf-cpu")
    assert ("CPUOffloadPolicy(" in source) == (strategy == "zero-inf-cpu")
    assert f'"reshard_after_forward": {strategy != "zero2"}' in source


# One gloo rank on the CPU: FSDP2 runs there (torch 2.13), CPUOffloadPolicy and the checkpoint and
# offload wrappers included. The sharded model must train exactly as the plain one does.
RUN_SNIPPET = textwrap.dedent("""
    import copy, json, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    namespace = {}
    exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), namespace)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3))
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    plain = Tiny()
    sharded = copy.deepcopy(plain)
    namespace["apply_plan"](sharded, sharded.blocks, init_device_mesh("cpu", (1,)))
    x = torch.randn(namespace["MICRO_BATCH_PER_GPU"], 16)
    losses = {}
    for name, model in (("plain", plain), ("sharded", sharded)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    param = next(sharded.parameters())
    print(json.dumps({"losses": losses, "type": type(param).__name__, "device": str(param.to_local().device)}))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("strategy", ["zero-inf-cpu", "zero3"])
def test_snippet_trains_a_tiny_model_on_one_gloo_rank(strategy, tmp_path):
    from runtime_support import free_port  # imports torch: only where the snippet runs
    source = fsdp2_snippet(plan(strategy, num_gpus=8, precision="fp32"))
    (tmp_path / "snippet.py").write_text(source)
    (tmp_path / "run.py").write_text(RUN_SNIPPET)
    result = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "snippet.py"), str(free_port())],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["type"] == "DTensor" and out["device"] == "cpu"
    assert out["losses"]["sharded"] == pytest.approx(out["losses"]["plain"], rel=1e-5)
    assert out["losses"]["sharded"][-1] < out["losses"]["sharded"][0]


def _fit(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tierwise", "fit", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "COLUMNS": "200"})


def test_fit_writes_the_framework_configs(tmp_path):
    result = _fit("1.4B", "--gpus", "8", "--placement", "params=cpu,gradients=cpu,optimizer_states=cpu",
                  "--tiling-factor", "1", "--accelerate-config", "acc.yaml", "--fsdp2-snippet", "shard.py", "--json",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan_doc = json.loads(result.stdout)
    doc = yaml.safe_load((tmp_path / "acc.yaml").read_text())
    assert doc["fsdp_config"]["fsdp_offload_params"] is True and doc["num_processes"] == 8
    assert doc["fsdp_config"]["fsdp_activation_checkpointing"] == (plan_doc["recompute_interval"] > 0)
    compile((tmp_path / "shard.py").read_text(), "shard.py", "exec")


def test_fit_refuses_an_nvme_framework_config_before_writing_anything(tmp_path):
    result = _fit("1T", "--gpus", "16", "--out", "plan.json", "--accelerate-config", "acc.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("error: the accelerate config cannot express this plan: NVMe placement")
    assert result.stderr.count("\n") == 1
    assert not any(tmp_path.iterdir())
