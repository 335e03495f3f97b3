"""The optimizer's engines, their worker thread and the schedules that run them: `AdamWEngine` with
its resident and NVMe-streamed implementations, the streamed chunks read ahead, the schedule
(after or in backward) as the model's unit listener, and fp16 loss scaling.

Above `runtime.units` (`RUNTIME_LAYERS` in tests/test_architecture.py). The public optimizer, which
ties an engine and a schedule to a sharded model, is `runtime.optimizer.AdamW`.
"""
