"""Every ``pip install`` the docs give resolves from the package index, as written.

Reads ``README.md``, ``backends/*/README.md``, ``docs/*.md`` and ``bench/*.md``, takes each ``pip install ...``
from their code blocks (fenced or indented; ``&&`` chains and ``\\`` continuations included) and inline code,
and resolves it with ``pip install --dry-run --ignore-installed`` into a fresh virtual environment, run from
the root of a clean copy of the checkout (the docs' relative paths are the repo root's: ``pip install .
./backends/torch``). Identical commands are resolved once, three at a time. pip reads the package index from
its configuration (``pip config list``), as a user's pip does; an unreachable index fails every command,
saying so.

A command that is not meant to run from the index (device wheels under ``--no-index``, placeholders) is
marked, with the reason, on the line before it::

    <!-- install-check: skip (the GPU machine has no package index) -->

Before a code block (its fence, or the first line of an indented block) the mark covers the whole block;
on its own line or at the end of a prose line, the inline commands that start on the next line. A mark
that covers no ``pip install``, a mark without a reason and a ``pip install`` outside code are errors.

    python tools/install_lines.py            # exit 1 naming file:line, the command and pip's error
    python tools/install_lines.py --list     # the commands, where each is written, what is skipped
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import pathlib
import queue
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("README.md", "backends/*/README.md", "docs/*.md", "bench/*.md")
MARK = re.compile(r"<!--\s*install-check:\s*skip\b\s*(?:\((?P<reason>[^)]*)\))?\s*-->")
PIP_INSTALL = re.compile(r"\bpip[\d.]*\s+install\b")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # CommonMark: closed by a run of the same length
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", ">", "<", ">>", "2>", "&>"}
# what pip says when it cannot reach an index (requests/urllib3 wording)
UNREACHABLE = re.compile(r"NewConnectionError|Network is unreachable|Temporary failure in name resolution|"
                         r"Name or service not known|Connection refused|ConnectTimeout|Max retries exceeded")
# pip's warnings that say nothing about the command (a find-links/index folder without that project)
NOISE = re.compile(r"is ignored: it is neither a file nor a directory")
TIMEOUT_S = 300
WORKERS = 3  # pip waits on the index and on its build subprocesses: three at a time keep two cores busy


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``pip install`` written in a doc: where, its arguments after ``install``, and its skip reason."""

    file: str
    line: int
    args: tuple[str, ...]
    skip: str | None = None

    @property
    def text(self) -> str:
        return "pip install " + shlex.join(self.args)


@dataclasses.dataclass(frozen=True)
class Snippet:
    """Shell text from a doc: ``line`` where it starts, ``anchor`` the line a skip mark must precede."""

    line: int
    anchor: int
    text: str


def split(lines: Sequence[str]) -> tuple[list[tuple[int, list[tuple[int, str]]]], list[tuple[int, str]]]:
    """A markdown file's code blocks ``(first line, [(line, text)])`` (fenced; indented after a blank line or a
    mark) and its prose lines (1-based; a block leaves an empty line, ending the paragraph before it)."""
    blocks: list[tuple[int, list[tuple[int, str]]]] = []
    prose: list[tuple[int, str]] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        fence = FENCE.match(line)
        indented = (line.startswith(("    ", "\t")) and line.strip() and
                    (i == 0 or not lines[i - 1].strip() or MARK.search(lines[i - 1])))
        if not (fence or indented):
            prose.append((i + 1, line))
            i += 1
            continue
        start, body = i + 1, []
        if fence:
            char, length = re.escape(fence.group(1)[0]), len(fence.group(1))
            close = re.compile(rf"^ {{0,3}}{char}{{{length},}}\s*$")
            i += 1
            while i < n and not close.match(lines[i]):
                body.append((i + 1, lines[i]))
                i += 1
            i += 1
        else:
            while i < n and (lines[i].startswith(("    ", "\t")) or not lines[i].strip()):
                body.append((i + 1, lines[i]))
                i += 1
        blocks.append((start, body))
        prose.append((start, ""))
    return blocks, prose


def snippets(lines: Sequence[str]) -> Iterator[Snippet]:
    """The shell text of a markdown file: code block lines (continuations joined) and inline code spans."""
    blocks, prose = split(lines)
    for start, body in blocks:
        yield from _logical_lines(body, anchor=start)
    yield from _code_spans(prose)


def _logical_lines(body: list[tuple[int, str]], anchor: int) -> Iterator[Snippet]:
    """A code block's shell lines, a trailing backslash joining the next."""
    text, first = "", 0
    for number, line in body:
        if not text:
            first = number
        if line.rstrip().endswith("\\"):
            text += line.rstrip()[:-1] + " "
            continue
        yield Snippet(first, anchor, text + line)
        text = ""
    if text:
        yield Snippet(first, anchor, text)


@dataclasses.dataclass(frozen=True)
class Paragraph:
    """Prose lines up to a blank line or a block: their line numbers, their text joined, its inline code spans."""

    numbers: list[int]
    text: str
    spans: list[re.Match[str]]

    def line(self, position: int) -> int:
        return self.numbers[self.text.count("\n", 0, position)]

    def outside_code(self, pattern: re.Pattern[str]) -> Iterator[re.Match[str]]:
        """Matches of ``pattern`` not inside a code span (a mark quoted in `inline code` is no mark)."""
        for m in pattern.finditer(self.text):
            if not any(span.start() <= m.start() < span.end() for span in self.spans):
                yield m


def paragraphs(prose: list[tuple[int, str]]) -> Iterator[Paragraph]:
    lines: list[tuple[int, str]] = []
    for number, line in [*prose, (0, "")]:
        if line.strip():
            lines.append((number, line))
            continue
        if lines:
            text = "\n".join(text for _, text in lines)
            yield Paragraph([n for n, _ in lines], text, list(CODE_SPAN.finditer(text)))
        lines = []


def _code_spans(prose: list[tuple[int, str]]) -> Iterator[Snippet]:
    """Inline code spans, each starting where its backticks open."""
    for paragraph in paragraphs(prose):
        for m in paragraph.spans:
            line = paragraph.line(m.start())
            yield Snippet(line, line, m.group(2).replace("\n", " ").strip())


def pip_installs(text: str) -> list[tuple[str, ...]]:
    """The argument lists after ``install`` of every ``pip install`` in one shell line (``python -m pip``,
    ``.venv/bin/pip`` and ``&&``/``;``/``|`` chains included); a command ends at a shell operator."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    found = []
    for i, token in enumerate(tokens[1:], start=1):
        if token == "install" and re.fullmatch(r"pip[\d.]*", os.path.basename(tokens[i - 1])):
            args = []
            for arg in tokens[i + 1:]:
                if arg in SHELL_OPERATORS:
                    break
                args.append(arg)
            found.append(tuple(args))
    return found


def commands(path: pathlib.Path, root: pathlib.Path = ROOT) -> tuple[list[Command], list[str]]:
    """The ``pip install`` commands of one markdown file, and its problems (stale or reasonless marks,
    ``pip install`` outside code, a command that does not parse)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    marks = {}
    problems = []
    _, prose = split(lines)
    for paragraph in paragraphs(prose):
        for m in paragraph.outside_code(MARK):
            number = paragraph.line(m.start())
            reason = (m.group("reason") or "").strip()
            if not reason:
                problems.append(f"{name}:{number}: install-check mark without a reason: write "
                                "<!-- install-check: skip (why) -->")
            marks[number + 1] = reason or "?"
        for m in paragraph.outside_code(PIP_INSTALL):
            problems.append(f"{name}:{paragraph.line(m.start())}: a pip install the check cannot read: write it "
                            "in a code block or `inline code`")
    found: list[Command] = []
    used: set[int] = set()
    for snippet in snippets(lines):
        if not PIP_INSTALL.search(snippet.text):
            continue
        try:
            args_list = pip_installs(snippet.text)
        except ValueError as e:  # shlex: an unclosed quote
            problems.append(f"{name}:{snippet.line}: cannot read the command ({e}): {snippet.text.strip()}")
            continue
        skip = marks.get(snippet.anchor)
        if skip is not None:
            used.add(snippet.anchor)
        found += [Command(name, snippet.line, args, skip) for args in args_list]
    for number in sorted(set(marks) - used):
        problems.append(f"{name}:{number - 1}: install-check mark covers no pip install on the next line "
                        "(the line after the mark: a code block's opening or the prose line with the command)")
    return found, problems


def doc_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return sorted({p for pattern in DOCS for p in root.glob(pattern)})


def pip_error(output: str) -> str:
    """The part of pip's output that says why: from its first ``ERROR:`` (else its first ``error:``, a build that
    failed) on, else its last lines; without warnings about folders that lack a project."""
    lines = [line for line in output.splitlines() if line.strip() and not NOISE.search(line)]
    first = next((i for i, line in enumerate(lines) if line.startswith("ERROR:")), None)
    if first is None:
        first = next((i for i, line in enumerate(lines) if line.lstrip().startswith("error:")),
                     max(0, len(lines) - 12))
    text = "\n".join(lines[first:first + 30])
    if UNREACHABLE.search(output):
        text = "the package index is unreachable (check `pip config list`):\n" + text
    return text


def resolve(args: Sequence[str], python: str, cwd: pathlib.Path) -> str | None:
    """pip's error where ``pip install ARGS`` does not resolve into the environment of ``python``, else None."""
    cmd = [sys.executable, "-m", "pip", "--python", python, "install", "--dry-run", "--ignore-installed",
           "--no-input", "--progress-bar", "off", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"pip did not finish in {TIMEOUT_S} s"
    return None if out.returncode == 0 else pip_error(out.stdout + out.stderr) or f"pip exited {out.returncode}"


def fresh_python(where: str) -> str:
    """A new, empty virtual environment's interpreter (no pip in it: this interpreter's pip drives it)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", where], check=True, capture_output=True)
    return os.path.join(where, "bin", "python")


def clean_checkout(root: pathlib.Path, where: pathlib.Path) -> pathlib.Path:
    """The checkout's files (tracked, or untracked and not ignored: what a clone of the commit has) copied to
    ``where``: each worker runs pip in its own copy, so no build leaves files in the checkout and parallel
    builds do not write one ``*.egg-info`` at once."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True)
    if listed.returncode == 0:
        for name in sorted(set(listed.stdout.decode().split("\0")) - {""}):
            source = root / name
            if source.is_file():
                (where / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, where / name)
    else:  # not a git checkout (an sdist, a copied tree): everything but build output and environments
        shutil.copytree(root, where, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".tox", ".venv", ".obs", ".whl", "*.egg-info", "build", "dist", "__pycache__", ".*_cache"))
    return where


def check(files: Sequence[pathlib.Path], root: pathlib.Path = ROOT, *, workers: int = WORKERS,
          log: Callable[[str], None] | None = None) -> tuple[list[Command], list[str]]:
    """Every command of ``files`` resolved (identical ones once), ``workers`` at a time: ``(commands,
    failures)``; each failure names file:line, the command and pip's error."""
    found, failures = [], []
    for path in files:
        cmds, problems = commands(path, root)
        found += cmds
        failures += problems
    distinct: dict[tuple[str, ...], list[Command]] = {}
    for c in found:
        if c.skip is None:
            distinct.setdefault(c.args, []).append(c)
    with tempfile.TemporaryDirectory(prefix="install-lines-") as tmp:
        python = fresh_python(os.path.join(tmp, "venv"))
        copies: queue.Queue[pathlib.Path] = queue.Queue()
        for i in range(max(1, min(workers, len(distinct)))):
            copies.put(clean_checkout(root, pathlib.Path(tmp, f"checkout{i}")))

        def run(args: tuple[str, ...]) -> tuple[str | None, float]:
            checkout = copies.get()
            try:
                t0 = time.perf_counter()
                return resolve(args, python, checkout), time.perf_counter() - t0
            finally:
                copies.put(checkout)

        with concurrent.futures.ThreadPoolExecutor(copies.qsize()) as pool:
            for where, (error, seconds) in zip(distinct.values(), pool.map(run, distinct)):
                if log:
                    log(f"{'ok  ' if error is None else 'FAIL'} {seconds:5.1f} s  {where[0].text}  "
                        f"({', '.join(f'{c.file}:{c.line}' for c in where)})")
                if error is not None:
                    failures += [f"{c.file}:{c.line}: `{c.text}` does not resolve from the package index "
                                 f"(run from the repo root):\n    " + error.replace("\n", "\n    ")
                                 for c in where]
    return found, failures


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=pathlib.Path, help="markdown files (default: the docs)")
    ap.add_argument("--list", action="store_true", help="list the commands, resolve nothing")
    ap.add_argument("--workers", type=int, default=WORKERS, help="pip processes at a time")
    a = ap.parse_args(argv)
    files = [p.resolve() for p in a.files] or doc_files()
    if a.list:
        for path in files:
            cmds, problems = commands(path)
            for c in cmds:
                print(f"{c.file}:{c.line}: {c.text}" + (f"   [skip: {c.skip}]" if c.skip else ""))
            for p in problems:
                print(p)
        return 0
    found, failures = check(files, workers=a.workers, log=lambda s: print(s, flush=True))
    for f in failures:
        print(f, file=sys.stderr)
    print(f"{len(found)} pip install commands in {len(files)} files; {len(failures)} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
