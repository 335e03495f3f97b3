"""The documents and their vocabularies: model, hardware, plan, profile, run history, presets.

Nothing here prices a plan; the cost models (`planner.cost`) read these documents.
"""
