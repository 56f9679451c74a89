"""Models and engines (level 1): device runtime, Hugging Face loading, GPU memory, the tiny
built-in model and the rollout engines (engines/: transformers, vLLM). Imports pipeline.core
and its own modules only.
"""
