"""The memory vocabulary: one name for every state or buffer that holds memory.

The memory bill (`planner/cost/memory.py`) is keyed by these terms, the simulator's tier trackers
(`planner/sim/`) hold them, and the runtime's ledger (`runtime/ledger.py`) refuses any other name, so a
profile's peak, a simulated peak and the bill compare term by term. Values are the bill's JSON keys
(`memory_terms`, a contract: docs/plan-format.md); a member *is* its value (`str`), so JSON and
dict look-ups by the plain string keep working.

[Note: adding a memory buffer]
1. One member below: its key, the tiers it can occupy, the simulator's label and a one-line formula
   (what `planner memory` and the dashboard print beside its bytes). The flags say whether it is
   transient GPU memory (`allocator_slack` is charged on those) and whether the runtime's ledger
   sees it (`runtime_buffer_peak_bytes` sums those).
2. Its formula in `planner/cost/memory.py`: a GPU buffer in `_gpu_buffers` if it grows with the
   micro-batch, else in `_operator_buffers` (`BatchBills` works those out once per batch search),
   a host buffer in `host_buffers` (none may grow with the batch); the bill puts it in its
   member's tier.
3. Where the runtime allocates it, `ledger.add(tier, MemoryTerm.X, nbytes)`; where the simulator
   models it, `gpu_add(rank, MemoryTerm.X, nbytes)` / `cpu_add(MemoryTerm.X, nbytes)`.
`tests/test_memory_terms.py` fails until some plan in its list produces the new term in the bill.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from planner.specs.tiers import GPU, HOST, TIERS

ALLOCATOR_SLACK_FRACTION = 0.10
"""Share of the transient GPU terms the caching allocator loses to rounding and fragmentation."""

_GPU = (GPU,)
_HOST = (HOST,)
# (transient, ledgered) of the members that are not held all iteration by the runtime:
_TRANSIENT = (True, True)  # a GPU buffer of the runtime's that comes and goes
_AUTOGRAD = (True, False)  # transient GPU tensors autograd owns: the ledger does not see them
_ALLOCATOR = (False, False)  # the caching allocator's own loss


class MemoryTerm(str, Enum):
    """A named amount of memory in the bill, the simulator and the runtime's ledger."""

    tiers: Sequence[str]
    """Tiers the term can lie in: a model state where the placement puts it (any of `TIERS`), a buffer in one."""
    label: str
    """The simulator's name for it: `details.simulated_memory_terms` keys (a contract, so the model
    states keep their keys), unique within each tier."""
    doc: str
    """One-line formula, in the bill's units (bytes per GPU or per node, `planner/cost/memory.py`)."""
    transient: bool
    """GPU memory that comes and goes within the iteration: the allocator's slack is charged on it."""
    ledgered: bool
    """The runtime's ledger tracks it; not autograd's tensors or allocator behaviour."""

    def __new__(cls, value: str, tiers: Sequence[str], label: str, doc: str, transient: bool = False,
                ledgered: bool = True) -> MemoryTerm:
        member = str.__new__(cls, value)
        member._value_ = value
        member.tiers, member.label, member.doc = tiers, label, doc
        member.transient, member.ledgered = transient, ledgered
        return member

    # Print as the value, as `str` does (Python 3.11 prints `MemoryTerm.PARAMS` for a mixed-in enum).
    __str__ = str.__str__
    __format__ = str.__format__

    # -- resident model states and recompute inputs (eq. 2, eq. 3) -----------------------------
    PARAMS = "params", TIERS, "params", "parameter shards: P/mp x bytes / dp (replicated: / 1) [eq. 2]"
    GRADIENTS = "gradients", TIERS, "gradients", "gradient shards: P/mp x bytes / dp (replicated: / 1) [eq. 2]"
    OPTIMIZER_STATES = ("optimizer_states", TIERS, "optimizer_states",
                        "fp32 master, momentum, variance, fp32 grad: P/mp x 16 / dp [eq. 2]")
    RECOMPUTE_INPUTS = ("recompute_inputs", TIERS, "recompute inputs",
                              "2 x bsz x seq x hd x ceil(nl / ci) [eq. 3]")
    # -- GPU working memory (eq. 4, eq. 5) and the runtime's GPU buffers ------------------------
    AWM = ("awm", _GPU, "activations", "activation working memory: bsz x seq x ci x (16 hd + 2 heads seq) [eq. 5]; "
           "flash: 16 hd + 4 heads", *_AUTOGRAD)
    MSWM = ("mswm", _GPU, "gathered params",
            "model-state working memory: largest operator's params + grads / (mp x tiling) [eq. 4]", *_TRANSIENT)
    PREFETCH_GATHERED_PARAMS = ("prefetch_gathered_params", _GPU, "prefetched params",
                                "next operator's gathered params, all-gathered ahead (depth >= 1)", *_TRANSIENT)
    PREFETCH_SHARD_STAGING = ("prefetch_shard_staging", _GPU, "param staging",
                              "operator i+2's shard staged on the GPU (depth >= 2, params in CPU memory)", *_TRANSIENT)
    REDUCE_SCATTER_BUFFER = ("reduce_scatter_buffer", _GPU, "gradient buckets",
                             "one operator's full gradients in flight to reduce-scatter", *_TRANSIENT)
    GRADIENT_OFFLOAD_STAGING = ("gradient_offload_staging", _GPU, "gradient staging",
                                "double buffer of gradient shards on their way off the GPU", *_TRANSIENT)
    RECOMPUTE_INPUT_OFFLOAD_STAGING = ("recompute_input_offload_staging", _GPU, "recompute input staging",
                                  "double buffer of one recompute input on its way to the CPU", *_TRANSIENT)
    RING_ATTENTION_BUFFERS = ("ring_attention_buffers", _GPU, "ring attention",
                              "context parallel: 4 x one GPU's KV block of a layer (2 KV, 2 dKV in flight), "
                              "bsz x seq x 2 kv width x bytes each (planner/cost/context_parallel.py)", *_TRANSIENT)
    LOGITS = ("logits", _GPU, "logits", "bsz x seq x vocab logits and their fp32 gradient", *_AUTOGRAD)
    NOT_AT_ONCE = ("not_at_once", _GPU, "not at once",
                   "minus what the working terms above never hold at once: the worst moment of the operator order "
                   "(largest unit, its neighbours, the gradients in flight; with recompute the logits or a "
                   "segment's activations, not both: planner/cost/coexisting.py)", *_AUTOGRAD)
    ALLOCATOR_SLACK = ("allocator_slack", _GPU, "allocator slack",
                       f"{ALLOCATOR_SLACK_FRACTION:.0%} of the transient GPU terms (caching allocator)", *_ALLOCATOR)
    # -- pinned host buffers of the NVMe stores and the host<->device copies, per-operator objects
    PARAM_SWAP_BUFFERS = ("param_swap_buffers", _HOST, "param staging",
                          "pinned NVMe->CPU buffers for parameter shards read ahead (depth >= 2: i+2; 3: i+3); "
                          "to a device of its own: min(depth, 3) + 1 pinned slots")
    OPTIMIZER_SWAP_BUFFERS = ("optimizer_swap_buffers", _HOST, "optimizer chunk buffers",
                              "pinned chunk buffers of the streamed NVMe optimizer step")
    GRADIENT_SWAP_BUFFERS = ("gradient_swap_buffers", _HOST, "gradient staging",
                             "pinned staging of gradient shards on their way to NVMe "
                             "(2; min(depth, 3) + 1 with params on NVMe), or to the in-backward "
                             "update on the host (2)")
    RUNTIME_BOOKKEEPING = ("runtime_bookkeeping", _HOST, "runtime bookkeeping",
                           "per-operator objects of the model and the runtime: "
                           "(nl x (2 norms + linears x tiling) + 3) x 64 KiB per rank")
    PINNED_STAGING_POOL = ("pinned_staging_pool", _HOST, "pinned staging",
                           "pinned host<->device staging of CPU-tier state: (max(depth, 1) + 2) buffers "
                           "x the largest unit's shard in fp32 (host not the device)")
    GRADIENT_LANDING_BUFFERS = ("gradient_landing_buffers", _HOST, "gradient landing",
                                "pinned buffers CPU-tier gradients land in off the device before the fp32 add: "
                                "P/mp x bytes / dp (host_pinning shards, host not the device)")


SUBTRACTED_TERMS = frozenset({MemoryTerm.NOT_AT_ONCE})
"""Terms whose bytes are negative: what the others' worst cases never hold together."""


def describe(name: str) -> str:
    """The formula of term `name`; '' for a name this version does not bill (a plan file written
    by another version)."""
    return MemoryTerm(name).doc if name in _VALUES else ""


_VALUES = frozenset(MemoryTerm)
