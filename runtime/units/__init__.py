"""A unit's lifetime through a step: building the units from a model (one per module that owns
parameters), gathering and resharding a unit (`ParamUnit`), prefetching in operator order, filing
its gradients, recompute and tiling, and the events a unit tells its listener.

Above `runtime.transfer`, below `runtime.optim` (`RUNTIME_LAYERS` in tests/test_architecture.py): a
unit moves its shards through the stores and is updated by whatever listens to its events.
"""
