import pytest

from pipeline.core.config import ConfigError, load_config, parse_value, preset_names


def test_presets_load_and_tiny_uses_digit_sort():
    assert {"tiny", "smoke"} <= set(preset_names())
    cfg = load_config("tiny")
    assert cfg.task.name == "digit_sort" and cfg.rollout.group_size == 8 and cfg.train.groups_per_update == 32
    assert cfg.train.beta == 0.01 and cfg.train.eps_low == 0.2 and cfg.train.dual_clip == 3.0


def test_tiny_regime_is_the_online_loop_on_countdown_with_refresh_for_every_method():
    from pipeline.core import grid
    cfg = load_config("tiny-regime")
    assert cfg.experiment.flow == "online" and cfg.task.name == "countdown" and cfg.train.updates == 128
    cells = grid.cells(cfg)
    assert [c.method for c in cells] == ["grpo", "grpo_tis", "agro", "ggpo"] * len(FIVE_SEEDS)
    assert [c.seed for c in cells[::4]] == list(FIVE_SEEDS)
    assert {c.config.train.refresh_every() for c in cells} == {10}
    # the staleness ladder of its header passes the online geometry checks (N = 64 included)
    from pipeline.dag.preflight import check_run
    _, ladder = check_run("online", "tiny-regime", {"experiment.grid": {"train.updates_per_step": [1, 4, 16, 64]},
                                                    "experiment.seeds": [42]})
    assert sorted({c.config.train.updates_per_step for c in ladder}) == [1, 4, 16, 64] and len(ladder) == 16


# issue #45: the corrections table and the testbed run five seeds unless told otherwise
FIVE_SEEDS = (42, 1234, 2027, 3407, 8191)


@pytest.mark.parametrize("preset", ["corrections", "tiny-regime", "tiny-regime-long", "tiny-regime-long-w4"])
def test_the_table_and_testbed_presets_default_to_five_seeds(preset):
    cfg = load_config(preset)
    assert cfg.experiment.seeds == list(FIVE_SEEDS) and cfg.seed == FIVE_SEEDS[0]
    assert load_config(preset, ["experiment.seeds=[42]"]).experiment.seeds == [42]


def test_overrides_from_cli_strings_and_dict():
    cfg = load_config("tiny", ["train.lr=2e-5", "eval.limit=20", "seed=7"])
    assert cfg.train.lr == 2e-5 and cfg.eval.limit == 20 and cfg.seed == 7
    assert load_config("tiny", {"train.updates": 3}).train.updates == 3


def test_parse_value_bare_lists():
    assert parse_value("[math500,aime24]") == ["math500", "aime24"]
    assert parse_value("1e-5") == 1e-5 and parse_value("abc") == "abc"


@pytest.mark.parametrize("bad, needle", [
    (["train.lr=-1"], "train.lr"),
    (["train.nope=1"], "nope"),
    (["train.method=ppo"], "method"),
    (["noequals"], "key=value"),
])
def test_bad_overrides_name_the_field(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("tiny", bad)


def test_unknown_preset_lists_known():
    with pytest.raises(ConfigError, match="known: .*tiny"):
        load_config("nope")


def test_slice_dotted_fields():
    cfg = load_config("tiny")
    assert cfg.slice(("seed", "task.name")) == {"seed": 42, "task": {"name": "digit_sort"}}


def test_seed_on_a_flow_sets_its_seeds_or_is_refused():
    """`--set seed=7` on a flow trains seed 7 (not the preset's seeds); with a different
    experiment.seeds it is one clear error."""
    from pipeline.core.config import ConfigError
    from pipeline.dag.preflight import check_run
    cfg, cells = check_run("offline", "smoke", ["seed=7"])
    assert cfg.experiment.seeds == [7] and {c.seed for c in cells} == {7}
    assert {c.config.seed for c in cells} == {7}
    cfg, _ = check_run("offline", "smoke", ["seed=7", "experiment.seeds=[7]"])
    assert cfg.experiment.seeds == [7]
    with pytest.raises(ConfigError, match=r"--set seed=7 and --set experiment.seeds=\[1, 2\] disagree"):
        check_run("offline", "smoke", ["seed=7", "experiment.seeds=[1,2]"])
