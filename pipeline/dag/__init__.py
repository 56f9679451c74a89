"""The DAG (level 3): stage specs and cached builds (spec.py: StageSpec, run_stage), which
stage feeds which and their keys (graph.py), placement of builds on Prefect/Ray and
preflight checks. Imports levels 0-2 and its own modules; stage modules are found by
name at run time (graph.spec), never imported here.
"""
