"""The hand check behind [Note: per-parameter collectives] (planner/cost/collectives.py) on Narayanan et al.
2021 Table 2's DeepSpeed ZeRO-3 rows.

    python benchmarks/zero3_gather_latency.py

Rows p021-p026 (GPT-3 175B and the 530B model, ZeRO-3 without model parallelism on 384-2,240 A100s) were
predicted +33..+266 % fast with flat, prefetched gathers. The hypothesis: DeepSpeed's 2021 ZeRO-3 gathered
parameters one `nn.Parameter` at a time, and each ring all-gather pays NCCL's latency, which grows with the
ring's rank count (planner/cost/collectives.py [Note: the alpha-beta collective]). The script prints, per
row, with the planner's prediction under flat, prefetched gathers (the row's `shard_collectives` set to
`flat`) as the baseline:
- the micro-batches each GPU runs per step (global batch / (GPUs x micro-batch));
- the measured step time (the row's TFLOPS under Table 1's FLOP formula) and the flat prediction's;
- NCCL's ring latency of one all-gather (or reduce-scatter: the same ring steps) at the row's rank
  count and its total over the step's per-parameter collectives: three gathers (forward, the recompute
  forward and backward) and one gradient reduce-scatter of each of 12 tensors per block (two layer
  norms' weight and bias; QKV, projection, fc1 and fc2 weight and bias: Megatron-DeepSpeed's GPT block)
  plus 4 outside the blocks (word and position embeddings, the final norm's weight and bias);
- the step's ZeRO-3 bytes per GPU (3 gathers and 1 reduce-scatter of 16-bit parameters) at the
  rate the planner gives the row's data-parallel ring (planner/cost/collectives.py `bus_bytes_per_s`);
- the bound with compute, latency and bytes all serialized (no overlap; DeepSpeed synchronizes the
  device before every gather), and the TFLOPS error it leaves.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.cost.collectives import Ring, bus_bytes_per_s, latency_s  # noqa: E402
from planner.validation.configure import node_for_row, row_plan  # noqa: E402
from planner.validation.corpus import load_corpus  # noqa: E402
from planner.validation.report import measured_metric, predict_row  # noqa: E402

ROWS = ("p021", "p022", "p023", "p024", "p025", "p026")
SEQ_LEN, VOCAB = 2048, 51200
"""arXiv:2104.04473 Sec. 5: every model trains at sequence 2048 with a 51,200-token vocabulary."""
TENSORS_PER_BLOCK, TENSORS_OUTSIDE_BLOCKS = 12, 4
GATHERS_PER_STEP = 3
"""Forward, the recompute forward (full recompute) and backward, each gathering every parameter."""
COLLECTIVES_PER_STEP = GATHERS_PER_STEP + 1
"""The gathers and the backward's reduce-scatter of each parameter's gradient."""


def table1_flops_per_step(layers: int, hidden: int, global_batch: int) -> float:
    """Narayanan et al. 2021 Eq. 3 (Table 1 and 2's FLOPs per iteration, recompute included)."""
    s, h = SEQ_LEN, hidden
    return 96 * global_batch * s * layers * h * h * (1 + s / (6 * h) + VOCAB / (16 * layers * h))


def main() -> None:
    rows = {row.row_id: row for row in load_corpus() if row.row_id in ROWS}
    print("row  GPUs mb/GPU  measured  flat pred.  excess | latency x collectives = total | bytes/GPU  "
          "at ring rate | serialized bound, TFLOPS error")
    for row_id in ROWS:
        row = rows[row_id]
        flat = dataclasses.replace(row, shard_collectives="flat")
        predicted = predict_row(flat, planned=row_plan(flat)).predicted
        measured = measured_metric(row)[1]
        node = node_for_row(row)
        gpus, layers, hidden = row.num_gpus, row.num_layers, row.hidden_size
        flops_per_gpu = table1_flops_per_step(layers, hidden, row.global_batch) / gpus
        measured_s = flops_per_gpu / (measured * 1e12)
        predicted_s = flops_per_gpu / (predicted * 1e12)
        gathers = COLLECTIVES_PER_STEP * (TENSORS_PER_BLOCK * layers + TENSORS_OUTSIDE_BLOCKS)
        one_gather_s = latency_s(Ring(gpus, node.num_gpus_per_node), "all_gather", node)
        step_bytes = (GATHERS_PER_STEP + 1) * 2 * 12 * layers * hidden * hidden
        bytes_s = step_bytes / bus_bytes_per_s(Ring(gpus, node.num_gpus_per_node), node, 1)
        serialized_s = predicted_s + gathers * one_gather_s + bytes_s
        print(f"{row_id} {gpus:5d} {row.global_batch // (gpus * row.micro_batch):3d} {measured_s:8.1f} s "
              f"{predicted_s:7.1f} s {measured_s - predicted_s:6.1f} s | {one_gather_s * 1e3:5.2f} ms x {gathers} = "
              f"{gathers * one_gather_s:5.1f} s | {step_bytes / 1e12:4.2f} TB {bytes_s:5.1f} s | "
              f"{serialized_s:6.1f} s, {measured_s / serialized_s - 1:+.0%}")


if __name__ == "__main__":
    main()
