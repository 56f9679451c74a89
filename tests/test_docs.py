"""The docs ship with the project and cannot drift silently from the code.

- nothing points outside the project; README opens with the two commands and cites the paper;
- every link the docs hold resolves: its file exists and its `#anchor` is a heading there
  (GitHub's slug rules: `heading_slug`), and every test they cite exists;
- every preset in pipeline/presets/ is named in the docs, and every preset the docs pass to
  `--preset` exists;
- every `ggpo` subcommand, positional choice and flag in the docs' code exists in the CLI's
  own argparse parser (pipeline/cli.py), read at test time;
- every dotted config key the docs name (`train.lr`) is a field of the config models
  (pipeline/core/config.py), read at test time, so new fields need no edit here;
- `make testbed` runs docs/testbed.md's three commands.

Each check is a function of a document's text, and a test feeds each a bad document to show
that it fails. All of it reads text and builds the parser: well under a second."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

OUTSIDE = "../" + "shared"        # spelled in two pieces so this file does not match itself
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


# ---- the text of a Markdown document -------------------------------------------------------

def split_code(text: str) -> tuple[list[str], str]:
    """(the fenced blocks' bodies, the text with them blanked out)."""
    return FENCE.findall(text), FENCE.sub("\n", text)


def code_commands(text: str) -> list[str]:
    """Every line of code: fenced lines (backslash continuations joined) and inline spans."""
    blocks, prose = split_code(text)
    lines = [re.split(r"(?:^|\s)#", line)[0] for body in blocks for line in body.replace("\\\n", " ").splitlines()]
    return lines + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def heading_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, every character that is
    not a letter, digit, `_`, `-` or space dropped, spaces made `-` (github-slugger)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)          # a link's text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a document's headings, repeated ones numbered as GitHub does (-1, -2)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", split_code(text)[1], re.M):
        slug = heading_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(text: str, where: Path) -> list[str]:
    """Links of a document at `where` whose file is missing or whose #anchor is no heading there."""
    bad = []
    for target in LINK.findall(split_code(text)[1]):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):          # http:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        file = (where.parent / path).resolve()
        if not path:
            if anchor not in anchors(text):
                bad.append(f"{where.name}: link {target} (no heading #{anchor} here)")
        elif not file.exists():
            bad.append(f"{where.name}: link {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            bad.append(f"{where.name}: link {target} (no heading #{anchor} in {file.name})")
    return bad


# ---- presets --------------------------------------------------------------------------------

def preset_names() -> list[str]:
    return sorted(p.stem for p in (REPO / "pipeline" / "presets").glob("*.toml"))


def unnamed_presets(texts: list[str], presets: list[str]) -> list[str]:
    """Presets that no document names as `name` (in backticks) or after --preset."""
    joined = "\n".join(texts)
    return [p for p in presets if f"`{p}`" not in joined and not re.search(rf"--preset[ =]{re.escape(p)}\b", joined)]


def unknown_presets(text: str, presets: list[str]) -> list[str]:
    """Presets that `--preset X` or `-p preset=X` in a document's code names and that do not exist."""
    named = []
    for line in code_commands(text):
        named += re.findall(r"--preset[ =]([\w.-]+)", line) + re.findall(r"\bpreset=([\w.-]+)", line)
    return sorted({n for n in named if n not in presets and not n.isupper() and n != "P"})


# ---- the ggpo command line ------------------------------------------------------------------

def placeholder(token: str) -> bool:
    """A word the docs put where a user types their own: NAME, P, <cache>, ..., k=v."""
    return token.isupper() or token.startswith("<") or "..." in token or "=" in token or token in ("k=v",)


def subparsers(parser):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return None


def cli_problems(text: str, parser) -> list[str]:
    """`ggpo ...` in a document's code whose subcommand, positional choice or flag the parser
    does not have. A command ends at a shell operator or a comment."""
    bad = []
    for line in code_commands(text):
        for match in re.finditer(r"(?:^|[\s/\"'(])ggpo\s+(?=(.*))", line):   # each ggpo, nested ones too
            rest = re.sub(r"<[^<>\s]*>", "X", match.group(1))
            lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            try:
                tokens = list(lexer)
            except ValueError:                 # an unclosed quote: an inline span cut short
                tokens = rest.split()
            bad += [f"`ggpo {match.group(1).strip()}`: {p}" for p in check_tokens(tokens, parser)]
    return bad


def check_tokens(tokens: list[str], parser) -> list[str]:
    """Walk the parser along `ggpo`'s argument words; what does not fit it."""
    problems: list[str] = []
    current, path, expect_value = parser, ["ggpo"], False
    positionals = [a for a in current._actions if not a.option_strings and a.choices and subparsers(current) is None]
    for raw in tokens:
        if set(raw) <= set("();<>|&"):
            break
        token = raw.strip("[]")
        if not token or token == "/":
            continue
        if token.startswith("-"):
            flag = token.split("=")[0]
            action = current._option_string_actions.get(flag) or parser._option_string_actions.get(flag)
            if action is None:
                problems.append(f"{' '.join(path)} has no flag {flag}")
                break
            expect_value = action.nargs != 0 and "=" not in token
            continue
        if expect_value:
            expect_value = False
            continue
        choices = subparsers(current)
        if choices is not None:
            if token in choices:
                current, path = choices[token], path + [token]
                positionals = [a for a in current._actions if not a.option_strings and subparsers(current) is None]
                continue
            if not re.fullmatch(r"[a-z][a-z-]*", token):
                break                            # not a command: a run's name ("ggpo N=4 seed=42")
            problems.append(f"{' '.join(path)} has no subcommand {token}")
            break
        if positionals:
            action = positionals.pop(0)
            if action.choices and token not in action.choices and not placeholder(token):
                problems.append(f"{' '.join(path)}: {token} is not one of {sorted(action.choices)}")
                break
    return problems


# ---- config keys ----------------------------------------------------------------------------

FILE_SUFFIX = r"(?:py|parquet|jsonl|json|md|csv|png|toml|pt|log|db|safetensors|txt|yaml|cff)\b"


def config_fields() -> dict[str, set[str]]:
    """Section -> its field names, read from the config models now (new fields included)."""
    from pipeline.core.config import PipelineConfig
    out = {}
    for name, field in PipelineConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and hasattr(model, "model_fields"):
            out[name] = set(model.model_fields)
    return out


def unknown_config_keys(text: str, fields: dict[str, set[str]]) -> list[str]:
    """`section.field` names in a document whose field the section does not have."""
    sections = "|".join(map(re.escape, fields))
    key = re.compile(rf"(?<![\w/.$-])({sections})\.([A-Za-z_]\w*)(?![\w-]|\.{FILE_SUFFIX}|/)")
    bad = {f"{s}.{f}" for s, f in key.findall(text) if f not in fields[s] and not re.fullmatch(FILE_SUFFIX, f)}
    return sorted(bad)


# ---- the tests ------------------------------------------------------------------------------

def test_no_file_refers_outside_the_project():
    hits = []
    for name in tracked_files():
        try:
            text = (REPO / name).read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if OUTSIDE in line]
    assert not hits, f"{OUTSIDE} in {hits}"


def test_readme_opens_with_the_two_commands_and_cites_the_paper():
    text = (REPO / "README.md").read_text()
    assert text.startswith("# ggpo\n\n```bash\nmake demo ")
    assert "\nmake test VLLM=cpu " in "\n".join(text.splitlines()[:6])
    assert "Gibbs-Gap Policy Optimization for Off-Policy RL with Verifiable Rewards" in text
    assert (REPO / "LICENSE").exists() and (REPO / "CITATION.cff").exists()


def readme_tree(text: str) -> list[str]:
    """The folders README's first code block after the commands names, as paths
    ("pipeline/core"), from its indented lines."""
    block = split_code(text)[0][1]
    folders, parent = [], ""
    for line in block.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.endswith("/"):
            continue
        if line.startswith("  "):
            folders.append(parent + name.rstrip("/"))
        else:
            parent = name
            folders.append(name.rstrip("/"))
    return folders


def test_readmes_first_screen_shows_the_house():
    text = (REPO / "README.md").read_text()
    head = "\n".join(text.splitlines()[:60])
    folders = readme_tree(text)
    assert folders and "\n".join(readme_tree(head)) == "\n".join(folders), "the tree ends past line 60"
    assert [f for f in folders if not (REPO / f).is_dir()] == []
    top = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name in
           {t.split("/")[0] for t in tracked_files()}}
    assert sorted(top - set(folders)) == [], "top-level folders README's tree does not name"
    roles = {p.name for p in (REPO / "pipeline").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert sorted(roles - {f.split("/", 1)[1] for f in folders if f.startswith("pipeline/")}) == []
    assert len(text.splitlines()) <= 230, "README is meant to be near 200 lines"


def test_the_tree_check_reads_nested_folders():
    text = "x\n```bash\nmake demo\n```\n\n```\na/    one\n  b/    two\nc/    three\n```\n"
    assert readme_tree(text) == ["a", "a/b", "c"]


def test_every_test_and_link_the_docs_cite_exists():
    missing = []
    for doc in docs():
        text = doc.read_text()
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", text):
            source = REPO / path
            if not source.exists() or not re.search(rf"^def {name}\(", source.read_text(), re.M):
                missing.append(f"{doc.name}: {path}::{name}")
        missing += broken_links(text, doc)
    assert not missing, missing


def test_every_preset_is_named_and_every_named_preset_exists():
    presets = preset_names()
    texts = [doc.read_text() for doc in docs()]
    assert not unnamed_presets(texts, presets)
    assert not [p for doc, text in zip(docs(), texts) for p in unknown_presets(text, presets)]


def test_every_ggpo_command_and_flag_in_the_docs_exists():
    from pipeline.cli import parser
    ap = parser()
    bad = [f"{doc.name}: {p}" for doc in docs() for p in cli_problems(doc.read_text(), ap)]
    assert not bad, bad


def test_every_config_key_the_docs_name_exists():
    fields = config_fields()
    bad = [f"{doc.name}: {k}" for doc in docs() for k in unknown_config_keys(doc.read_text(), fields)]
    assert not bad, bad


def test_make_testbed_runs_the_testbed_pages_commands():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}   # CI runs us under make
    recipe = subprocess.run(["make", "-n", "testbed", "BIN=.venv/bin"], cwd=REPO, capture_output=True, env=env,
                            text=True, check=True).stdout          # -n: printed, nothing runs
    made = [line.split("ggpo", 1)[1] for line in recipe.splitlines() if "/ggpo run " in line]
    page = (REPO / "docs" / "testbed.md").read_text()
    block = next(b for b in split_code(page)[0] if "ggpo run offline --preset tiny-regime" in b)
    listed = [" " + " ".join(line.split("ggpo", 1)[1].split()) for line in block.replace("\\\n", " ").splitlines()]
    assert [" ".join(c.split()) for c in made] == [c.strip() for c in listed] and len(made) == 3


# ---- each check fails on a bad document ------------------------------------------------------

def test_the_link_check_fails_on_a_broken_anchor_and_a_missing_file(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The laptop testbed (`--preset tiny-regime`)\n")
    doc = tmp_path / "doc.md"
    good = "[a](other.md#the-laptop-testbed---preset-tiny-regime) [b](#mine) [c](https://x.org/#y)\n\n## Mine\n"
    assert broken_links(good, doc) == []
    assert broken_links("[a](other.md#the-laptop-testbed)\n", doc) == [
        "doc.md: link other.md#the-laptop-testbed (no heading #the-laptop-testbed in other.md)"]
    assert broken_links("[a](#nowhere)\n", doc)
    assert broken_links("[a](gone.md)\n", doc) == ["doc.md: link gone.md (no such file)"]
    assert broken_links("```\n[a](gone.md)\n```\n", doc) == []         # code is not a link


def test_heading_slugs_follow_githubs_rules():
    assert heading_slug("3. GRPO + TIS (truncated importance sampling)") == "3-grpo--tis-truncated-importance-sampling"
    assert heading_slug("5.5 Clipped variant (`train.ggpo_clip_delta`, *choice*: our reading of the paper's Fig. 10)") \
        == "55-clipped-variant-trainggpo_clip_delta-choice-our-reading-of-the-papers-fig-10"
    assert heading_slug("The testbed, in one table") == "the-testbed-in-one-table"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_the_preset_checks_fail_on_an_unnamed_and_an_unknown_preset():
    presets = ["smoke", "tiny"]
    assert unnamed_presets(["`tiny` and `smoke`"], presets) == []
    assert unnamed_presets(["only `tiny`"], presets) == ["smoke"]
    assert unknown_presets("`ggpo run offline --preset tiny`", presets) == []
    assert unknown_presets("```bash\nggpo report --preset tiny-extra\n```\n", presets) == ["tiny-extra"]
    assert unknown_presets("`prefect deployment run ggpo/offline -p preset=nope`", presets) == ["nope"]


def test_the_cli_check_fails_on_an_unknown_subcommand_choice_and_flag():
    from pipeline.cli import parser
    ap = parser()
    good = ("```bash\n.venv/bin/ggpo run offline --preset tiny --set 'experiment.grid={\"train.lr\": [1]}' \\\n"
            "    --force train evaluate\nggpo cache gc --yes --unreferenced   # a comment --nope\n```\n"
            "`ggpo stage NAME [--preset P] [--set k=v ...] [--force]`, `ggpo pool import SOURCE --map a=b`, "
            "`eval \"$(.venv/bin/ggpo env)\"`, runs named `ggpo N=4 seed=42`, `ggpo: disk full`\n")
    assert cli_problems(good, ap) == []
    assert cli_problems("`ggpo launch offline`", ap) == ["`ggpo launch offline`: ggpo has no subcommand launch"]
    assert cli_problems("`ggpo run sideways`", ap) == [
        "`ggpo run sideways`: ggpo run: sideways is not one of ['corrections', 'offline', 'online']"]
    assert cli_problems("```\nggpo cache gc --really\n```\n", ap) == [
        "`ggpo cache gc --really`: ggpo cache has no flag --really"]
    assert cli_problems("`ggpo pool import x.jsonl --trust-everything`", ap)


def test_the_config_key_check_fails_on_an_unknown_key():
    fields = {"train": {"lr", "t_ref"}, "eval": {"prompt"}}
    good = ("`--set train.lr=1e-5`, train.t_ref, `eval.prompt`; files stages/train.py, eval.parquet, "
            "pipeline/training/loop.py, http://train.example; `$train.x`")
    assert unknown_config_keys(good, fields) == []
    assert unknown_config_keys("--set train.learning_rate=1 and eval.promt", fields) == [
        "eval.promt", "train.learning_rate"]


@pytest.mark.parametrize("field", ["train.lr", "online.drift_every", "experiment.task_runner", "pool.score_model"])
def test_the_config_key_check_reads_the_models(field):
    section, name = field.split(".")
    assert name in config_fields()[section]
