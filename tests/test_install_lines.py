"""Every ``pip install`` in the README, the backends' READMEs, docs/ and bench/ resolves from the package index
as written (``tools/install_lines.py``: ``pip install --dry-run`` into a fresh venv, from the repo root)."""

import importlib.util
import sys

from imports import ROOT

spec = importlib.util.spec_from_file_location("install_lines", ROOT / "tools" / "install_lines.py")
install_lines = sys.modules.setdefault("install_lines", importlib.util.module_from_spec(spec))
spec.loader.exec_module(install_lines)

FENCE = "```"
SAMPLE = [
    "# t",                                                                                  # 1
    "Intro `pip install a` and `python -m pip install",                                     # 2
    "b c` across lines.",                                                                   # 3
    "",                                                                                     # 4
    FENCE + "sh",                                                                           # 5
    "python3 -m venv .venv && .venv/bin/pip install -q d 'e[x]' && .venv/bin/python run.py",  # 6
    "pip install f \\",                                                                     # 7
    "  g  # a comment",                                                                     # 8
    FENCE,                                                                                  # 9
    "",                                                                                     # 10
    "<!-- install-check: skip (device wheels) -->",                                         # 11
    "    pip install --no-index h.whl",                                                     # 12
    "    pip install i",                                                                    # 13
    "",                                                                                     # 14
    "Carry it, then <!-- install-check: skip (no index there) -->",                         # 15
    "`pip install j` there.",                                                               # 16
    "",                                                                                     # 17
    "<!-- install-check: skip (stale) -->",                                                 # 18
    "Nothing here.",                                                                        # 19
    "",                                                                                     # 20
    "<!-- install-check: skip -->",                                                         # 21
    "`pip install k`",                                                                      # 22
    "",                                                                                     # 23
    "A bare pip install l outside code.",                                                   # 24
    "",                                                                                     # 25
    "A mark quoted, `<!-- install-check: skip (why) -->`, marks nothing:",                  # 26
    "`pip install m`",                                                                      # 27
    "",                                                                                     # 28
    "Fetch `pip download n",                                                                # 29
    "-d w` here, then <!-- install-check: skip (no index) -->",                             # 30
    "`pip install w/n.whl` there.",                                                         # 31
]


def test_reads_code_blocks_inline_code_chains_and_skip_marks(tmp_path):
    doc = tmp_path / "t.md"
    doc.write_text("\n".join(SAMPLE) + "\n")
    found, problems = install_lines.commands(doc, tmp_path)
    assert [(c.line, c.args, c.skip) for c in found] == [
        (6, ("-q", "d", "e[x]"), None),
        (7, ("f", "g"), None),
        (12, ("--no-index", "h.whl"), "device wheels"),  # a mark before a block covers the block
        (13, ("i",), "device wheels"),
        (2, ("a",), None),
        (2, ("b", "c"), None),  # an inline span across lines
        (16, ("j",), "no index there"),  # a mark at the end of the line before
        (22, ("k",), "?"),
        (27, ("m",), None),
        (31, ("w/n.whl",), "no index"),
    ]
    assert problems == [
        "t.md:21: install-check mark without a reason: write <!-- install-check: skip (why) -->",
        "t.md:24: a pip install the check cannot read: write it in a code block or `inline code`",
        "t.md:18: install-check mark covers no pip install on the next line (the line after the mark: a code "
        "block's opening or the prose line with the command)",
    ]


def test_a_command_that_does_not_resolve_fails_naming_file_line_and_pip_error(tmp_path):
    """The two lines the docs had: the adapter alone (its ``unimp>=0.1`` is not on the index) and the adapter by
    its distribution name (not on the index either)."""
    doc = tmp_path / "old.md"
    doc.write_text("Install:\n\n`pip install ./backends/keras`\n\nor `pip install 'unimp-keras[jax]'`.\n")
    found, failures = install_lines.check([doc], ROOT)
    assert len(found) == 2 and len(failures) == 2, failures
    assert failures[0].startswith(f"{doc}:3: `pip install ./backends/keras` does not resolve"), failures[0]
    assert "unimp>=0.1" in failures[0] and "No matching distribution" in failures[0], failures[0]
    assert failures[1].startswith(f"{doc}:5: `pip install 'unimp-keras[jax]'` does not resolve"), failures[1]
    assert "unimp-keras" in failures[1] and "No matching distribution" in failures[1], failures[1]


def test_an_unreachable_index_fails_saying_so(tmp_path, monkeypatch):
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no configured index: only the dead one below
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")  # pip names the connection error when it retries
    doc = tmp_path / "t.md"
    doc.write_text("`pip install tox`\n")
    _, failures = install_lines.check([doc], ROOT)
    assert len(failures) == 1 and "the package index is unreachable" in failures[0], failures


def test_every_documented_pip_install_resolves_from_the_index():
    found, failures = install_lines.check(install_lines.doc_files(), ROOT)
    checked = {c.file for c in found if c.skip is None}
    assert {"README.md", "backends/keras/README.md", "backends/ipex/README.md", "backends/paddle/README.md",
            "backends/tensorflow/README.md"} <= checked, checked
    assert not failures, "\n".join(failures)
