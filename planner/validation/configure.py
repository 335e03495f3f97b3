"""A corpus row -> the planner's Plan under exactly the configuration the row states, or the reasons
it cannot be one.

The planner is given what the source states and nothing fitted to the row; an unstated tuning knob
is searched as `planner fit` searches an unpinned one, and a row that lacks what the planner needs
keeps a reason naming it and counts as a miss ([Note: what a row states], above `row_plan`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from planner.cost.feasibility import check_plan
from planner.search.search import DEFAULT_MAX_MICRO_BATCH
from planner.specs.catalog import hardware_presets, model_presets
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import STRATEGY_TABLE, Plan
from planner.specs.stack import Fp8Recipe, KvExchange, ShardCollectives
from planner.specs.units import GIB
from planner.validation.corpus import CorpusRow
from planner.validation.flash_kernels import (
    SOURCE_FLASH_KERNEL,
    FlashKernel,
    kernel_name,
    row_flash_kernel,
    with_flash_kernel,
)
from planner.validation.unstated import (
    SEARCHED_RECOMPUTES,
    SHARDINGS_ANY,
    SHARDINGS_OFFERED,
    default_micro_batches,
    search_unstated,
    sized,
)

# GPU family (and stated memory) -> hardware preset. The lower-TDP 94 GB H100 of torchtitan's
# 405B runs has no preset of its own: it is an H100 SXM with the row's memory (its clocks are lower,
# so the prediction is optimistic there; docs/validation.md says so).
HARDWARE_FOR: dict[tuple[str, float | None], str] = {
    ("V100", None): "dgx2-v100",
    ("A100", 40): "dgx-a100-40g",
    ("A100", None): "dgx-a100-80g",
    ("H100", None): "dgx-h100",
    ("H200", None): "h200-x1",
}
NODE_FOR_GPUS_PER_NODE: dict[tuple[str, int], str] = {("H200", 8): "hgx-h200"}
"""(GPU family, GPUs per node) -> the preset of a multi-GPU node, for rows that span more GPUs than
HARDWARE_FOR's preset has in a node (torchtitan's 8-GPU H200 nodes)."""
# source_id -> column -> (value, where the source states it). Nothing here is fitted.
SOURCE_DEFAULTS: dict[str, dict[str, tuple[object, str]]] = {
    "llmfoundry_bench": {
        "tensor_parallel": (1, "every row's note: 'no TP/PP in this benchmark'"),
        "pipeline_parallel": (1, "every row's note: 'no TP/PP in this benchmark'"),
    },
    "narayanan2021_t2": {
        "seq_len": (2048, "arXiv:2104.04473 Sec. 5: sequence length 2048 for all models"),
        "vocab_size": (51200, "arXiv:2104.04473 Sec. 5: vocabulary 51,200 for all models"),
        "activation_recompute": ("full", "Table 2 uses Table 1's FLOP formula, which includes the recompute pass"),
    },
    "opt2022": {
        "seq_len": (2048, "arXiv:2205.01068 Sec. 2.2: OPT-175B trained on sequences of 2048 tokens"),
    },
    "megatron_bridge_archive": {
        "precision": ("fp8", "the 25.09 H100 table's section notes state its FP8 scaling granularity (the rows' notes); "
                             "every other row of this archive states FP8 or FP8-CS"),
    },
}
SOURCE_ATTENTION: dict[str, tuple[str, str]] = {
    source: ("eager", f"{cite}: Megatron-LM's fused scale-mask-softmax stores the scores; FlashAttention came in "
                      "2022 (Dao et al., arXiv:2205.14135)")
    for source, cite in (("megatron2019", "arXiv:1909.08053 (2019)"), ("narayanan2021_t1", "arXiv:2104.04473 (2021)"),
                         ("narayanan2021_t2", "arXiv:2104.04473 (2021)"))
}
"""source_id -> (attention kernel, why): the default for a row whose `attention` cell is empty, for
sources that predate fused attention kernels. Any other row with an empty cell gets the plan's default,
flash where the GPU has it (planner/cost/kernels.py [Note: attention kernels])."""
SOURCE_STACK: dict[str, tuple[Fp8Recipe, KvExchange, str]] = {
    source: (Fp8Recipe.TORCHAO_TENSORWISE, KvExchange.ALL_GATHER,
             "torchtitan: its float8 converter makes torchao Float8Linear with dynamic tensorwise scaling (the "
             "default recipe), and its context parallelism is PyTorch's context_parallel (default rotate method "
             "all-gather)")
    for source in ("torchtitan_perfmd_2408", "torchtitan_h200_2506")
}
"""source_id -> (fp8 recipe, KV exchange, why) for sources that do not train on Megatron-Core and
Transformer Engine; every other source's fp8 rows run Transformer Engine (NeMo, Megatron-Bridge,
Megatron-LM, and llm-foundry's `amp_fp8`, Transformer Engine's fp8_autocast) with delayed scaling,
its default recipe, and ring attention's point-to-point exchange. A row whose precision names its
scaling overrides the source (`_fp8_recipe`: `FP8-CS` current scaling, `rowwise`)."""
SOURCE_DROPOUT: dict[str, str] = {
    source: "Megatron-LM's defaults --hidden-dropout 0.1 --attention-dropout 0.1 (megatron/arguments.py), the code "
            "these benchmarks ran"
    for source in ("megatron2019", "narayanan2021_t1", "narayanan2021_t2")
}
"""source_id -> why its blocks train with dropout (planner/cost/kernels.py: the dropout kernels and masks)."""
MEGATRON_GPT_BLOCK = {"qkv_bias": True, "attn_out_bias": True, "mlp_bias": True, "norm": "layernorm"}
"""Megatron-LM's GPT block (megatron/model/transformer.py): every linear has a bias (its
ColumnParallelLinear and RowParallelLinear default), both norms are LayerNorm with a weight and a bias.
Given to the rows of the sources that ran Megatron-LM's GPT (SOURCE_DROPOUT's): it adds their biases and
norm weights to the parameter count and the block's parameter tensors (what a per-parameter ZeRO-3
gathers: planner/cost/collectives.py [Note: per-parameter collectives])."""
SOURCE_SHARD_COLLECTIVES: dict[str, tuple[ShardCollectives, str]] = {
    "narayanan2021_t2": (ShardCollectives.PER_PARAMETER,
                         "DeepSpeed ZeRO-3 of April 2021 (v0.3.13-v0.5.x): one all-gather per parameter after a "
                         "device-wide synchronize, one reduce-scatter per parameter's gradient"),
}
"""source_id -> (how its ZeRO-3 grouped parameters into collectives, why): the default for a ZeRO-3 row
whose `shard_collectives` cell is empty; any other row gathers flat units (`ShardCollectives.FLAT`)."""
PARAMETER_SHARDINGS = ("zero3", "fsdp")
"""The `sharding` values that shard the parameters, where `shard_collectives` is read."""
_LLAMA = re.compile(r"llama[\s_-]*(\d)(?:\.\d)?[\s_-]*(\d+)b", re.I)
_GPT3 = re.compile(r"gpt[\s-]*3[\s_-]*(\d+)b", re.I)
_NAMED = ((_LLAMA, "llama-{}-{}b"), (_GPT3, "gpt3-{}b"), (re.compile(r"^opt[\s_-]*(\d+)b", re.I), "opt-{}b"),
          (re.compile(r"qwen[\s_-]*(\d(?:\.\d)?)[\s_-]*(\d+)b", re.I), "qwen{}-{}b"),
          (re.compile(r"nemotron(?:[\s_-]*4)?[\s_-]+(\d+)b", re.I), "nemotron-4-{}b"),
          (re.compile(r"nemotron[\s_-]+(\d+)b", re.I), "nemotron-{}b"), (re.compile(r"bloom[\s_-]*(\d+)b", re.I), "bloom-{}b"),
          (re.compile(r"mt[\s_-]*nlg[\s_-]*(\d+)b", re.I), "mt-nlg-{}b"))
"""Model-name patterns -> preset keys (data/models/), tried in order until one names a preset; a name
with no preset is predicted from its shape columns, or keeps its reason."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RowPlan:
    """What the planner is asked for one row: a plan and its accumulation, or why there is none."""

    plan: Plan | None
    grad_accumulation: int = 1
    """Micro-steps per optimizer step (`global / (micro x data parallel)`)."""
    reasons: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
    """Unstated values filled from the source (SOURCE_DEFAULTS) or the batch rule, for the report."""
    searched: tuple[str, ...] = ()
    """The unstated tuning knobs the planner chose (planner/validation/unstated.py); the presets'
    fit leaves such rows out: it calibrates on configurations the sources state."""
    flash_kernel: FlashKernel | None = None
    """The FlashAttention generation the row's fused attention runs (None: no fused attention);
    the plan's node already has its rate (planner/validation/flash_kernels.py)."""
    unlike_preset: str = ""
    """Why the row's GPU is not its preset's ('' where it is): such a row is predicted at the
    preset's rates and does not calibrate them ([Note: a part the preset does not describe])."""


# [Note: what a row states] The planner is given what the source states and nothing fitted to the row:
# - shape from the row's columns; GQA, SwiGLU, embedding tying and rotary embeddings from the model's
#   published config (the bundled presets, data/models/: Llama, GPT-3 and NeMo's GPT-3 5B/20B,
#   OPT, Qwen2.5, Nemotron, BLOOM, MT-NLG, matched by name: _NAMED), rotary for Llama (Touvron et al. 2023,
#   arXiv:2302.13971 Sec. 2); a row of any other name that states layers, hidden size and heads is a
#   GPT block (4h GELU MLP unless `ffn_hidden_size` says otherwise, tied embeddings, multi-head); a
#   name with no preset and no shape columns ("GPT-2-like 1.4B") keeps a reason;
# - recompute: `full` (every block from its segment's recompute input), `selective` (the attention core's seq^2 part
#   only), torchtitan's `every_nth_block` (with the row's `recompute_block_period`) and `op_level`, or `none`; the attention kernel is the row's `attention` column, else its source's where the
#   source predates fused attention (SOURCE_ATTENTION: eager), else the GPU's default (flash on
#   A100/H100/H200); Megatron-LM sources train with its
#   default dropout (SOURCE_DROPOUT);
# - an unstated shape, sequence, vocabulary or precision is filled only from what the source itself
#   says elsewhere (SOURCE_DEFAULTS, each with its citation); otherwise the row gets a reason;
# - an unstated tuning knob is searched as `planner fit` searches what a user leaves unpinned
#   (planner/validation/unstated.py [Note: unstated settings are searched]): recompute, data-parallel
#   sharding (among what the row's framework offers), the tensor x pipeline split of a stated
#   model-parallel size (an FSDP/ZeRO row with no pipeline degree: 1, the planner pipelines only
#   `3d`), the micro-batch of a pipelined row given its global batch, and with no batch at all the
#   largest micro-batch that fits (no accumulation, or `planner fit`'s 4 per stage when pipelined);
#   stated values are never searched, and `assumptions` names every searched knob and its choice;
# - micro-batch per model replica and gradient accumulation `global / (micro x data parallel)`; an
#   unstated micro-batch of an unpipelined row with a stated global batch means no accumulation
#   (`micro = global / dp`);
# - context parallelism from the note's `CP=k` (NeMo, Megatron-Bridge) or what the stated degrees leave
#   over (GPUs / (TP x PP x DP)): planner/cost/context_parallel.py;
# - the plan's `micro_batch_per_gpu` is the replica's micro-batch over the tensor, context and pipeline
#   degrees (planner.specs.plan.Plan: one replica spans `gpus_per_replica` GPUs), and its
#   `micro_batches_per_step` is the accumulation, so the planner times the whole optimizer step
#   (pipeline bubble, one gradient reduction per step: planner/cost/pipeline.py);
# - interleaved pipelines from the note's `VP=k` (NeMo, Megatron-Bridge), or searched where the note
#   says only "interleaved" ([Note: an interleaved schedule of unstated depth]);
# - sequence parallelism where the note says "sequence parallel(ism)" and TP > 1; none otherwise;
# - fp8 rows (`FP8`, `amp_fp8`, `float8 linears`) as bf16 with `fp8_matmuls` (planner/cost/fp8.py); on a
#   GPU without an fp8 rate the planner refuses them, naming the hardware; their casts and a CP row's
#   KV exchange follow the training stack (SOURCE_STACK, `_stack`);
# - a GPU family's preset (HARDWARE_FOR), or its multi-GPU node where the row spans more GPUs than the
#   preset has in a node (NODE_FOR_GPUS_PER_NODE: hgx-h200).
# A reason names the missing planner feature (a GPU with no preset, a model with no published shape)
# or the missing statement (sequence length not stated); such rows count as misses.
def row_plan(row: CorpusRow) -> RowPlan:
    """The plan for `row`, or its reasons (every one found, not just the first); unstated settings are
    searched (planner/validation/unstated.py [Note: unstated settings are searched])."""
    reasons: list[str] = []
    assumptions: list[str] = []
    value = _stated(row, assumptions)
    model = _model(row, value, reasons)
    attention = _attention(row, assumptions)
    kernel = _flash_kernel(row, attention, assumptions)
    node = _kernel_rate(row, _node(row, reasons), kernel, reasons)
    precision_text = value("precision") or ""
    precision = _precision(precision_text, reasons)
    cp = context_parallel(row)
    layouts = _layouts(row, value, model, node, cp, reasons, assumptions)
    recompute = value("activation_recompute")
    shardings = _shardings(row, {row.num_gpus // (tp * pp * cp) for tp, pp in layouts}, reasons)
    micros = _micro_batches(row, layouts, cp, reasons, assumptions)
    if cp > 1:
        assumptions.append(f"context_parallel = {cp} (the row's note or its stated degrees)")
    if reasons or model is None or node is None:
        return RowPlan(plan=None, reasons=tuple(reasons), assumptions=tuple(assumptions))
    options = {"tensor x pipeline": layouts, "activation_recompute": (recompute,) if recompute else SEARCHED_RECOMPUTES,
               "sharding": shardings, "micro_batch": micros,
               "pipeline_virtual_stages": _virtual_stage_options(row, layouts, model, assumptions)}
    searched = [k for k, v in options.items() if len(v) > 1 or v == (None,)]
    recipe, exchange = _stack(row, precision_text, cp, assumptions)
    grouping = _shard_collectives(row, assumptions)
    stated_virtual = _VIRTUAL_STAGES.search(row.notes or "") is not None

    def build(choice: dict) -> Plan | None:
        (tp, pp), micro = choice["tensor x pipeline"], choice["micro_batch"]
        dp = row.num_gpus // (tp * pp * cp)
        accumulation = 1 if micro is None or row.global_batch is None else row.global_batch // (micro * dp)
        if micro is not None and row.global_batch is not None and row.global_batch % (micro * dp):
            return None
        virtual = choice["pipeline_virtual_stages"]
        if virtual > 1 and not stated_virtual and not interleaves(model.num_layers, pp, virtual, accumulation if micro else None):
            return None  # a searched chunk count Megatron would refuse (a stated one is taken as stated)
        strategy = SHARDING_STRATEGY.get(choice["sharding"], choice["sharding"])
        shard = grouping if choice["sharding"] in PARAMETER_SHARDINGS else ShardCollectives.FLAT
        synchronous = {"prefetch_depth": 0} if shard is ShardCollectives.PER_PARAMETER else {}
        period = {"recompute_block_period": row.recompute_block_period} if row.recompute_block_period else {}
        placement = STRATEGY_TABLE[strategy].placement
        plan = Plan(model=model, node=node, num_gpus=row.num_gpus, strategy=strategy, placement=placement,
                    micro_batch_per_gpu=(micro or 1) / (tp * cp * pp), recompute=choice["activation_recompute"],
                    recompute_interval=1 if choice["activation_recompute"] == "full" else 0, attention=attention,
                    model_parallel_degree=tp, pipeline_parallel_degree=pp, pipeline_virtual_stages=virtual,
                    context_parallel_degree=cp,
                    micro_batches_per_step=accumulation if micro else default_micro_batches(pp), precision=precision,
                    fp8_matmuls=uses_fp8(precision_text), fp8_recipe=recipe, kv_exchange=exchange,
                    sequence_parallel=tp > 1 and states_sequence_parallel(row), shard_collectives=shard, **synchronous,
                    **period)
        check_plan(plan)
        return plan if micro is not None else sized(plan) or plan  # one sample not fitting: billed, refused

    plan, searched_notes, why = search_unstated(build, options, searched)
    if plan is None:
        return RowPlan(plan=None, reasons=(f"the planner refuses the configuration: {why}",),
                       assumptions=tuple(assumptions))
    unlike = gpu_part_unlike_preset(row)
    return RowPlan(plan=plan, grad_accumulation=plan.micro_batches_per_step,
                   assumptions=(*assumptions, *searched_notes, *([unlike] if unlike else [])), searched=tuple(searched),
                   flash_kernel=kernel if plan.attention == "flash" else None, unlike_preset=unlike)


_SEQUENCE_PARALLEL = re.compile(r"(?<!no )(?<!without )\bsequence[- ]parallel(?:ism)?\b", re.IGNORECASE)


def states_sequence_parallel(row: CorpusRow) -> bool:
    """Whether the row's note says the run used Megatron's sequence parallelism (Korthikanti et al.
    2022 Sec. 4.2.2); a row that does not say runs without it."""
    return _SEQUENCE_PARALLEL.search(row.notes or "") is not None


_VIRTUAL_STAGES = re.compile(r"\bVP\s*=\s*(\d+)")
_INTERLEAVED = re.compile(r"\binterleaved\b", re.IGNORECASE)


# [Note: an interleaved schedule of unstated depth] Megatron's interleaved 1F1B splits each stage's
# `L / p` blocks into `v` equal model chunks (Narayanan et al. 2021, Sec. 2.2.2: the bubble shrinks to
# `(p - 1) / (v m)`, each micro-batch crosses `v` times as many stage boundaries), and its schedule
# needs the step's micro-batches to be a multiple of `p` (Megatron-LM's
# `forward_backward_pipelining_with_interleaving` asserts it). A row whose note states the chunk count
# (`VP=k`) gets it; a row whose note says only that the schedule was interleaved (Narayanan et al.
# 2021, Sec. 5.1: "we use the interleaved pipeline schedule with the scatter/gather optimization
# enabled" for Table 1) leaves `v` unstated, so it is searched like any other unstated knob ([Note:
# unstated settings are searched] in planner/validation/unstated.py) over every `v >= 2` the stage's
# blocks divide into; a row that says neither runs plain 1F1B (`v = 1`).
def _virtual_stage_options(row: CorpusRow, layouts: tuple[tuple[int, int], ...], model: ModelSpec | None,
                           assumptions: list[str]) -> tuple[int, ...]:
    """Interleaved model chunks per GPU: the note's `VP=k`, else every `v >= 2` that splits a
    pipelined layout's stage into equal chunks where the note says the schedule was interleaved, else
    1 ([Note: an interleaved schedule of unstated depth])."""
    notes = row.notes or ""
    stated = _VIRTUAL_STAGES.search(notes)
    if stated:
        return (max(1, int(stated.group(1))) if (row.pipeline_parallel or 1) > 1 else 1,)
    if model is None or not _INTERLEAVED.search(notes) or all(pp == 1 for _, pp in layouts):
        return (1,)
    options = tuple(sorted({v for _, pp in layouts if pp > 1 for v in range(2, model.num_layers // pp + 1)
                            if interleaves(model.num_layers, pp, v, None)}))
    if len(options) == 1:
        assumptions.append(f"pipeline_virtual_stages = {options[0]} (the note says the schedule was interleaved: "
                           f"the only split of a stage's blocks into 2 or more equal chunks)")
    return options or (1,)


def interleaves(layers: int, stages: int, virtual: int, micro_batches: int | None) -> bool:
    """Whether Megatron's interleaved schedule runs `layers` blocks on `stages` stages of `virtual`
    equal chunks each with `micro_batches` per step (None: not yet known)."""
    if stages < 2 or layers % (stages * virtual):
        return False
    return micro_batches is None or micro_batches % stages == 0


def _flash_kernel(row: CorpusRow, attention: str, assumptions: list[str]) -> FlashKernel:
    """The FlashAttention generation a fused-attention row runs: its column's, else its source's stack's
    (planner/validation/flash_kernels.py [Note: FlashAttention generations])."""
    kernel = row_flash_kernel(row.attention, row.source_id)
    if attention != "eager" and row.attention not in {k.value for k in FlashKernel} and row.source_id in SOURCE_FLASH_KERNEL:
        assumptions.append(f"fused attention = {kernel_name(kernel)} ({SOURCE_FLASH_KERNEL[row.source_id][1]})")
    return kernel


def _kernel_rate(row: CorpusRow, node: NodeSpec | None, kernel: FlashKernel, reasons: list[str]) -> NodeSpec | None:
    """`node` with its fused attention at `kernel`'s rate (the preset's is FlashAttention-2's); a row
    that names a FlashAttention generation on a GPU with no fused-attention rate keeps a reason."""
    if node is None:
        return None
    if row.attention in {k.value for k in FlashKernel} and not node.flash_attention_flops_per_s:
        reasons.append(f"no {kernel_name(kernel)} rate for {row.gpu_family}")
        return None
    return with_flash_kernel(node, kernel)


def _attention(row: CorpusRow, assumptions: list[str]) -> str:
    """The row's attention kernel: its `attention` column (`flash1`/`flash2` are flash at that
    generation's rate, `_kernel_rate`), else its source's (SOURCE_ATTENTION), else the GPU's default
    ('': flash where the GPU has it)."""
    if row.attention:
        return "flash" if row.attention in {k.value for k in FlashKernel} else row.attention
    if row.source_id not in SOURCE_ATTENTION:
        return ""
    kernel, why = SOURCE_ATTENTION[row.source_id]
    assumptions.append(f"attention = {kernel} ({why})")
    return kernel


def _stated(row: CorpusRow, assumptions: list[str]):
    defaults = SOURCE_DEFAULTS.get(row.source_id, {})

    def value(column: str):
        stated = getattr(row, column)
        if stated not in (None, "") or column not in defaults:
            return stated
        filled, why = defaults[column]
        assumptions.append(f"{column} = {filled} ({why})")
        return filled

    return value


def preset_for_name(name: str) -> ModelSpec | None:
    """The published config a row's `model_name` refers to ("LLAMA3.1_405B" -> llama-3-405b)."""
    presets = model_presets()
    for pattern, key in _NAMED:
        match = pattern.search(name)
        if match and key.format(*match.groups()).lower() in presets:
            return presets[key.format(*match.groups()).lower()][0]
    return None


def _model(row: CorpusRow, value, reasons: list[str]) -> ModelSpec | None:
    preset = preset_for_name(row.model_name)
    shape = {k: getattr(row, k) for k in ("num_layers", "hidden_size", "num_heads")}
    seq, vocab = value("seq_len"), value("vocab_size")
    if preset is not None:
        fields = {k: v if v is not None else getattr(preset, k) for k, v in shape.items()}
        fields.update(ffn_hidden_size=row.ffn_hidden_size or preset.ffn_hidden_size, num_kv_heads=preset.num_kv_heads,
                      gated_mlp=preset.gated_mlp, tied_embeddings=preset.tied_embeddings,
                      vocab_size=vocab or preset.vocab_size, rotary=preset.rotary or bool(_LLAMA.search(row.model_name)))
    elif None not in shape.values():
        fields = dict(shape, ffn_hidden_size=row.ffn_hidden_size or 0, vocab_size=vocab or 0, tied_embeddings=True)
        if vocab is None:
            reasons.append("vocabulary size not stated")
    else:
        missing = ", ".join(k for k, v in shape.items() if v is None)
        reasons.append(f"model shape not stated: {row.model_name!r} has no preset in data/models and no {missing}")
        return None
    if seq is None:
        reasons.append("sequence length not stated")
        return None
    if row.source_id in SOURCE_DROPOUT:
        fields.update(dropout=True, **MEGATRON_GPT_BLOCK)
    try:
        return ModelSpec(name=f"{row.model_name} ({row.row_id})", seq_len=seq, **fields)
    except PlannerError as exc:
        reasons.append(f"the planner refuses the shape: {exc}")
        return None


def _preset_node(row: CorpusRow) -> tuple[str, NodeSpec] | str:
    """The name and spec of the row's GPU's hardware preset, or why there is none."""
    name = HARDWARE_FOR.get((row.gpu_family, row.gpu_memory_gb)) or HARDWARE_FOR.get((row.gpu_family, None))
    if name is None:
        return f"no hardware preset for {row.gpu_type}"
    node = hardware_presets()[name]
    if row.gpus_per_node is not None and row.num_gpus > node.num_gpus_per_node != row.gpus_per_node:
        name = NODE_FOR_GPUS_PER_NODE.get((row.gpu_family, row.gpus_per_node), name)
        node = hardware_presets()[name]
    if row.gpus_per_node is not None and row.num_gpus > node.num_gpus_per_node != row.gpus_per_node:
        return f"no preset for {row.gpus_per_node}-GPU {row.gpu_family} nodes ({name} has {node.num_gpus_per_node})"
    return name, node


def node_for_row(row: CorpusRow) -> NodeSpec | str:
    """The hardware preset of the row's GPU, or why there is none; a part with more memory than the
    preset's keeps the preset's rates ([Note: a part the preset does not describe])."""
    found = _preset_node(row)
    if isinstance(found, str):
        return found
    name, node = found
    if gpu_part_unlike_preset(row):
        node = node.replace(name=f"{name} ({row.gpu_memory_gb:g} GB part)", gpu_memory_bytes=row.gpu_memory_gb * GIB)
    return node


# [Note: a part the preset does not describe] A row whose GPU has more memory than its family's
# preset (torchtitan's Llama 3.1 405B rows, p219-p221: an H100 SXM with 94 GB of HBM2e and a lower
# power limit, whose peak its source says lies between the SXM's and the NVL's and is not known) is
# another part: a different memory technology, bandwidth and clocks. It is predicted with the
# preset's rates (its memory is the row's), as an assumption the report names, and it does not
# calibrate them (planner/validation/fit.py `fit_rows`): the fit calibrates the preset's GPU on
# the hardware the sources state, as it does on the settings they state.
def gpu_part_unlike_preset(row: CorpusRow) -> str:
    """Why the row's GPU is not its preset's ('' where it is; [Note: a part the preset does not
    describe])."""
    found = _preset_node(row)
    if isinstance(found, str) or row.gpu_memory_gb is None or row.gpu_memory_gb * GIB <= found[1].gpu_memory_bytes:
        return ""
    name, node = found
    return (f"the {row.gpu_memory_gb:g} GB part is not {name}'s {node.gpu_memory_bytes / GIB:g} GiB GPU: priced at "
            "the preset's rates, which its rows do not calibrate")


def _node(row: CorpusRow, reasons: list[str]) -> NodeSpec | None:
    node = node_for_row(row)
    if isinstance(node, str):
        reasons.append(node)
        return None
    return node


def _shard_collectives(row: CorpusRow, assumptions: list[str]) -> ShardCollectives:
    """How the row's ZeRO-3 grouped parameters into collectives: its `shard_collectives` cell, else its
    source's (SOURCE_SHARD_COLLECTIVES), else flat units; read only where the plan shards parameters."""
    if row.shard_collectives:
        return ShardCollectives(row.shard_collectives)
    if row.source_id not in SOURCE_SHARD_COLLECTIVES or row.sharding not in PARAMETER_SHARDINGS:
        return ShardCollectives.FLAT
    grouping, why = SOURCE_SHARD_COLLECTIVES[row.source_id]
    assumptions.append(f"shard_collectives = {grouping.value}, prefetch_depth = 0 ({why})")
    return grouping


def _stack(row: CorpusRow, precision_text: str, cp: int, assumptions: list[str]) -> tuple[Fp8Recipe, KvExchange]:
    """The row's fp8 recipe and KV exchange: its source's (SOURCE_STACK, else Transformer Engine's
    delayed scaling and the point-to-point ring), the recipe overridden by a precision that names its
    scaling; the choices that matter to the row are named in `assumptions`."""
    recipe, exchange, why = SOURCE_STACK.get(row.source_id, (
        Fp8Recipe.TE_DELAYED, KvExchange.RING, "Megatron-Core / Transformer Engine: delayed scaling, its default "
                                               "recipe; point-to-point ring attention"))
    lowered = precision_text.lower()
    if "fp8-cs" in lowered or "current scaling" in lowered:
        recipe, why = Fp8Recipe.TE_CURRENT, "the row's precision: Transformer Engine current scaling"
    elif "rowwise" in lowered:
        recipe, why = Fp8Recipe.TORCHAO_ROWWISE, "the row's precision: torchao rowwise scaling"
    if uses_fp8(precision_text):
        assumptions.append(f"fp8_recipe = {recipe.value} ({why})")
    if cp > 1:
        assumptions.append(f"kv_exchange = {exchange.value} ({why})")
    return recipe, exchange


def uses_fp8(text: str) -> bool:
    """Whether the row's precision trains its linears in fp8 (Transformer Engine FP8 / FP8-CS,
    llm-foundry amp_fp8, torchao Float8 linears); weights and the rest stay 16-bit."""
    lowered = text.lower()
    return "fp8" in lowered or "float8" in lowered


def _precision(text: str, reasons: list[str]) -> str:
    lowered = text.lower()
    if uses_fp8(text):
        return "bf16"  # the 16-bit format of everything but the linears' matmuls (planner/cost/fp8.py)
    if "bf16" in lowered:
        return "bf16"
    elif "fp16" in lowered or "16-bit" in lowered:
        return "fp16"
    elif not lowered:
        reasons.append("precision not stated")
    else:
        reasons.append(f"precision {text!r} not understood")
    return "bf16"


def _shardings(row: CorpusRow, replicas: set[int], reasons: list[str]) -> tuple[str, ...]:
    """Sharding options (corpus names, SHARDING_STRATEGY): the stated one, or those the row's framework
    offers (unstated.SHARDINGS_OFFERED) when the row has more than one replica."""
    tier = row.offload_tier
    if tier is not None:
        # ZeRO-Infinity's strategy for the tier (parameters and optimizer states there), or ZeRO-Offload's.
        infinity = next((name for name, s in STRATEGY_TABLE.items()
                         if s.placement.params == tier == s.placement.optimizer_states), None)
        name = infinity if row.params_offloaded and infinity is not None else "zero-offload"
        if name == "zero-offload" and tier != STRATEGY_TABLE[name].placement.optimizer_states:
            reasons.append(f"optimizer-only {tier.label} offload with parameters on the GPU: no planner strategy")
        return (name,)
    if row.sharding:
        return (row.sharding,)
    if (row.data_parallel or 0) == 1 or replicas == {1}:
        return ("none",)  # a single replica: nothing to shard
    return SHARDINGS_OFFERED.get(row.source_id, SHARDINGS_ANY)


SHARDING_STRATEGY: dict[str, str] = {"none": "dp", "zero1": "3d", "zero2": "zero2", "zero3": "zero3", "fsdp": "zero3"}
"""zero1 is the distributed optimizer: partitioned optimizer states, gradients reduced once per step (`3d`)."""
_CONTEXT_PARALLEL = re.compile(r"\bCP\s*=\s*(\d+)")
_MODEL_PARALLEL_SIZE = re.compile(r"model-parallel size (\d+)")


def context_parallel(row: CorpusRow) -> int:
    """The context-parallel degree the row's note states (`CP=2`: NeMo, Megatron-Bridge), else what its
    stated degrees leave over (GPUs / (TP x PP x DP)), else 1."""
    match = _CONTEXT_PARALLEL.search(row.notes or "")
    if match:
        return max(1, int(match.group(1)))
    tp, pp, dp = row.tensor_parallel, row.pipeline_parallel, row.data_parallel
    if None not in (tp, pp, dp) and row.num_gpus % (tp * pp * dp) == 0:
        return row.num_gpus // (tp * pp * dp)
    return 1


def _layouts(row: CorpusRow, value, model: ModelSpec | None, node: NodeSpec | None, cp: int, reasons: list[str],
             assumptions: list[str]) -> tuple[tuple[int, int], ...]:
    """(tensor, pipeline) options: the stated pair, or the splits of a model-parallel size the note states
    (Narayanan et al. 2021 Table 2), or every tensor degree of an FSDP/ZeRO row (which the planner
    does not pipeline); tensor degrees are powers of two within a node that divide the heads."""
    tp, pp = value("tensor_parallel"), value("pipeline_parallel")
    if tp is not None and pp is not None:
        return ((tp, pp),)
    if model is None or node is None:
        return ((tp or 1, pp or 1),)
    per_node, tps, degree = node.num_gpus_per_node, [], 1
    while degree <= per_node and model.num_heads % degree == 0 and row.num_gpus % (degree * cp) == 0:
        tps.append(degree)
        degree *= 2
    tps = [tp] if tp is not None else tps
    size = _MODEL_PARALLEL_SIZE.search(row.notes or "")
    if size:
        mp = int(size.group(1))
        pairs = [(t, mp // t) for t in tps if mp % t == 0 and mp // t <= model.num_layers and pp in (None, mp // t)]
    elif pp is None and row.sharding in ("fsdp", "zero2", "zero3"):
        assumptions.append(f"pipeline_parallel = 1 (the row's {row.sharding} sharding: the planner pipelines only `3d`)")
        pairs = [(t, 1) for t in tps]
    elif pp is not None:
        pairs = [(t, pp) for t in tps]
    else:
        reasons.append("parallel layout not stated (tensor/pipeline degrees, nor a model-parallel size)")
        return ()
    if not pairs:
        reasons.append(f"no tensor x pipeline split of {row.num_gpus} GPUs fits the stated degrees")
    return tuple(pairs)


def _micro_batches(row: CorpusRow, layouts: tuple[tuple[int, int], ...], cp: int, reasons: list[str],
                   assumptions: list[str]) -> tuple[int | None, ...]:
    """Micro-batch per replica options (None: the largest that fits, [Note: unstated settings are searched])."""
    micro, global_batch = row.micro_batch, row.global_batch
    dps = {tp * pp: row.data_parallel or row.num_gpus // (tp * pp * cp) for tp, pp in layouts}
    if any(dp * mp * cp != row.num_gpus for mp, dp in dps.items()):
        reasons.append(f"GPUs {row.num_gpus} are not TP x PP x CP {cp} x DP for "
                       f"{', '.join(f'TP x PP {mp}, DP {dp}' for mp, dp in dps.items())}")
        return ()
    if micro is not None:
        if len(layouts) == 1 and global_batch is not None and global_batch % (micro * next(iter(dps.values()))):
            dp = next(iter(dps.values()))
            reasons.append(f"global batch {global_batch} is not micro {micro} x data parallel {dp} x a whole accumulation")
        if global_batch is None:
            assumptions.append("no gradient accumulation (global batch not stated)")
        return (micro,)
    if global_batch is None:
        return (None,)
    if all(pp == 1 for _, pp in layouts) and len(layouts) == 1:
        dp = next(iter(dps.values()))
        if global_batch % dp:
            reasons.append(f"global batch {global_batch} is not a multiple of data parallel {dp}")
            return ()
        assumptions.append(f"micro_batch = global {global_batch} / data parallel {dp} (no accumulation stated)")
        return (global_batch // dp,)
    per_replica = {global_batch // dp for dp in dps.values() if global_batch % dp == 0}
    options = sorted({m for n in per_replica for m in range(1, min(n, DEFAULT_MAX_MICRO_BATCH) + 1) if n % m == 0})
    if not options:
        reasons.append(f"global batch {global_batch} is not a multiple of data parallel {sorted(set(dps.values()))}")
    return tuple(options)
