"""The README names only files that exist: every repository path in its inline code and links (a newcomer
opens them first)."""

import re

from imports import ROOT

TOP = {"unimp", "backends", "docs", "examples", "bench", "policies", "tests", "tests_models", "tools", ".ci"}


def repo_paths(text: str) -> set[str]:
    """Paths under the repository's top-level folders written in `inline code` or ](links), without a
    ``:factory``/``#anchor`` suffix, an ``[extra]`` or a leading ``./``; placeholders (``<name>``, globs) left out."""
    found = set()
    for m in re.finditer(r"`([^`\n]+)`|\]\(([^)\s]+)\)", text):
        for token in re.split(r"[\s,;()]+", m.group(1) or m.group(2)):
            token = re.sub(r"\[[^\]]*\]$", "", re.sub(r"[:#].*$", "", token.strip("'\"")))
            token = token.removeprefix("./")
            if "/" in token and token.split("/")[0] in TOP and not re.search(r"[<>*{}$=]", token):
                found.add(token)
    return found


def test_every_path_the_readme_names_exists():
    paths = repo_paths((ROOT / "README.md").read_text())
    assert {"examples/team_policy.toml", "examples/torch_train.py", "docs/design.md"} <= paths, sorted(paths)
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []
