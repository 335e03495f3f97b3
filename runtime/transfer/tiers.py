"""Placement tier -> shard store type: the one place that names every tier's `ShardStore`.

A new tier is a `ShardStore` subclass plus one entry in `STORE_TYPES`; nothing else checks a
placement string (runtime/transfer/stores.py).
"""

from __future__ import annotations

from typing import Any

from runtime.ledger import MemoryLedger
from runtime.transfer.crossings import Crossing
from runtime.transfer.host_store import HostStore
from runtime.transfer.nvme_store import NvmeStore
from runtime.transfer.stores import CopyEngine, DeviceStore, ShardStore

STORE_TYPES: dict[str, type[ShardStore]] = {"gpu": DeviceStore, "cpu": HostStore, "nvme": NvmeStore}
"""Placement tier -> store type."""


def make_store(tier: str, *, term: str, ledger: MemoryLedger, copier: CopyEngine, name: str = "",
               swap: Any = None, crossing: Crossing | None = None) -> ShardStore:
    """A store of `tier` for model state `name`; `swap` is the rank's `NvmeSpace` (nvme tier only),
    `crossing` how host shards cross the link (cpu tier only; runtime/transfer/crossings.py)."""
    if tier not in STORE_TYPES:
        raise ValueError(f"placement {name or term}={tier} is not supported by this runtime; use gpu, cpu or nvme")
    extra = {"crossing": crossing} if crossing is not None else {}
    return STORE_TYPES[tier](term=term, ledger=ledger, copier=copier, name=name, swap=swap, **extra)
