"""Placement tier -> shard store type: the one place that names every tier's `ShardStore`.

A new tier is a `ShardStore` subclass plus one entry in `STORE_TYPES`; nothing else checks a
placement string (runtime/transfer/stores.py).
"""

from __future__ import annotations

from typing import Any

from runtime.ledger import MemoryLedger
from runtime.transfer.nvme_store import NvmeStore
from runtime.transfer.stores import CopyEngine, DeviceStore, HostStore, ShardStore

STORE_TYPES: dict[str, type[ShardStore]] = {"gpu": DeviceStore, "cpu": HostStore, "nvme": NvmeStore}
"""Placement tier -> store type."""


def make_store(tier: str, *, term: str, ledger: MemoryLedger, copier: CopyEngine, name: str = "",
               swap: Any = None) -> ShardStore:
    """A store of `tier` for model state `name`; `swap` is the rank's `NvmeSpace` (nvme tier only)."""
    if tier not in STORE_TYPES:
        raise ValueError(f"placement {name or term}={tier} is not supported by this runtime; use gpu, cpu or nvme")
    return STORE_TYPES[tier](term=term, ledger=ledger, copier=copier, name=name, swap=swap)
