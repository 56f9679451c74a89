"""benchmarks/testbed_cost.py runs end to end at tiny sizes (the smoke preset's base)."""
import sys

from conftest import REPO


def test_testbed_cost_benchmark_runs(base_manifest, capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import testbed_cost
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    result = testbed_cost.main(["--preset", "smoke", "--rounds", "2", "--reps", "1",
                                "--set", "train.updates_per_step=1", "--set", "train.groups_per_update=2"])
    assert result["cell_ms_per_update"] > 0 and result["bare_ms_per_update"] > 0 and result["ratio"] > 0
    assert "cell / bare loop per update" in capsys.readouterr().out


def test_trl_compare_runs(base_manifest, capsys):
    """benchmarks/trl_compare.py at tiny sizes, where TRL is installed (not a dependency)."""
    import pytest
    pytest.importorskip("trl")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import trl_compare
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    result = trl_compare.main(["--preset", "smoke", "--steps", "2"])
    assert result["trl_s_per_step"] > 0 and result["ggpo_s_per_step"] > 0
    assert "ggpo / TRL per step" in capsys.readouterr().out


def test_decode_step_benchmark_runs_and_draws_the_same(base_manifest, capsys):
    """benchmarks/decode_step.py at tiny sizes: both forwards time, and their draws agree."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import decode_step
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    result = decode_step.main(["--preset", "smoke", "--prompts", "2", "5", "--draws", "2", "--reps", "2"])
    assert result["lean_supported"]        # the built-in tiny model: the lean step really runs
    sizes = [v for k, v in result.items() if k.startswith("rows_")]
    assert len(sizes) == 2 and all(s["same_draws"] and s["lean_over_transformers"] > 0 for s in sizes)
    assert "lean / transformers" in capsys.readouterr().out
