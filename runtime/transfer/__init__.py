"""Moving bytes between tiers and ranks: the shard stores of each placement tier (device, host,
NVMe) behind one interface, the copy engine and the pinned staging pool that carry host <-> device
copies, the landing add into fp32 host shards, and the collectives between ranks.

Below `runtime.units`, above `runtime.nvme` (`RUNTIME_LAYERS` in tests/test_architecture.py): a
store knows shards by key, never the unit or the optimizer that uses them.
"""
