"""The docs ship with the project: nothing points outside it, README's first screen shows the
two commands and the folder tree, and every test or file the docs cite exists."""
from __future__ import annotations

import re
import subprocess

from conftest import REPO

OUTSIDE = "../" + "shared"        # spelled in two pieces so this file does not match itself


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def test_no_file_refers_outside_the_project():
    hits = []
    for name in tracked_files():
        try:
            text = (REPO / name).read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if OUTSIDE in line]
    assert not hits, f"{OUTSIDE} in {hits}"


def test_readme_opens_with_the_two_commands_and_the_folder_tree():
    first_screen = "\n".join((REPO / "README.md").read_text().splitlines()[:45])
    assert first_screen.startswith("# ggpo\n\n```bash\nmake demo ")
    assert "\nmake test VLLM=cpu " in first_screen
    for folder in ("pipeline/", "stages/", "flows/", "docs/", "tests/", "data/"):
        assert f"\n{folder} " in first_screen, folder


def test_every_test_and_link_the_docs_cite_exists():
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", text):
            source = REPO / path
            if not source.exists() or not re.search(rf"^def {name}\(", source.read_text(), re.M):
                missing.append(f"{doc.name}: {path}::{name}")
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            if not (doc.parent / target).exists():
                missing.append(f"{doc.name}: link {target}")
    assert not missing, missing
