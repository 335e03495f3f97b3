"""A unit's ledger accounting: what its staged or gathered buffers are charged to, as they change slots.

A shard staged ahead, then gathered, then claimed for use is one buffer passing through the memory
bill's terms (`runtime.units.group.STAGE_TERMS`: device staging, prefetched, working memory); its charge
moves with it and is released on reshard. Kept apart from the gather lifecycle that decides the
moves (`ParamUnit`), as FSDP2 keeps its parameter's memory apart from its group's state machine.
"""

from __future__ import annotations

from typing import Any

from runtime.ledger import MemoryLedger


class UnitCharges:
    """The (tier, term, bytes) entries one unit holds in the ledger, and the read buffer it holds
    outside its recycler's bound."""

    def __init__(self, ledger: MemoryLedger) -> None:
        self.ledger = ledger
        self._held: list[tuple[str, str, int]] = []
        """(tier, term, bytes) charged for the staged or gathered buffers, released on reshard."""
        self._outside: tuple[Any, int] | None = None
        """(recycler, bytes) while a copy of a read buffer stands in for it in the recycler's bound."""

    @property
    def held(self) -> bool:
        return bool(self._held)

    def charge(self, tier: str, term: str, num_bytes: int) -> None:
        self.ledger.add(tier, term, num_bytes)
        self._held.append((tier, term, num_bytes))

    def retag(self, old: str, new: str) -> None:
        """Move the entries charged to term `old` to the device term `new`."""
        for i, (tier, term, b) in enumerate(self._held):
            if term == old:
                self.ledger.sub(tier, old, b)
                self.ledger.add("gpu", new, b)
                self._held[i] = ("gpu", new, b)

    def retag_all(self, tier: str, term: str) -> None:
        held, self._held = self._held, []
        for old_tier, old_term, b in held:
            self.ledger.sub(old_tier, old_term, b)
            self.charge(tier, term, b)

    def release(self) -> None:
        for tier, term, b in self._held:
            self.ledger.sub(tier, term, b)
        self._held = []

    def hold_outside(self, recycler: Any, num_bytes: int) -> None:
        """A copy of `num_bytes` takes a read buffer's place in `recycler`'s bound until released."""
        self.release_outside()
        recycler.hold_outside(num_bytes)
        self._outside = (recycler, num_bytes)

    def release_outside(self) -> None:
        if self._outside is not None:
            recycler, num_bytes = self._outside
            self._outside = None
            recycler.release_outside(num_bytes)
