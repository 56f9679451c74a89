"""The core every layer uses (level 0): errors, paths, seeding, typed config and presets,
the method table, the experiment grid, the content-addressed store (local and remote),
Arrow schemas, metrics and interrupts. Imports nothing of the project outside pipeline.core
(the method table names its loss functions by dotted string, resolved lazily).
"""
