"""Tasks and verifiers (level 1): the built-in tasks and prompt sets (catalog.py), countdown,
grading with math-verify, the shipped benchmarks and imported pool sources. Imports
pipeline.core and its own modules only.
"""
