"""Files whole or not at all (issue 32): every file unimp writes goes through :mod:`unimp.files`.

Patterns: *full disk* -- a subprocess with a small ``RLIMIT_FSIZE`` (SIGXFSZ ignored, so a write past it
gets EFBIG, as a full disk gets ENOSPC) must leave no partial file and give one located error; *FIFO* --
a named pipe as the target answers within a second (opening one for writing waits for a reader);
*replace* -- an existing file is replaced whole and the CLI says so.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import unimp
from unimp.cli import main
from unimp.errors import FileError, UnimpWarning
from unimp.files import AppendLog, write_file
from unimp.watch import Watch

ROOT = Path(__file__).resolve().parents[1]
LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
{body}
"""
DS = json.dumps({"fp16": {"enabled": True, "loss_scale_window": 500}, "zero_optimization": {"stage": 1}})
needs_limits = pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this system")


def limited(body: str, limit: int, cwd: Path) -> subprocess.CompletedProcess:
    """``body`` in a fresh interpreter whose files may not grow past ``limit`` bytes."""
    # no bytecode written under the limit: a .pyc cut short there would break every later import of that module
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-B", "-c", LIMITED.format(limit=limit, body=body)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def cli(args: list[str]) -> str:
    return f"from unimp.cli import main; sys.exit(main({args!r}))"


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def answers_within_a_second(fn, *args, **kwargs):
    """What ``fn`` returned or raised, asserting it came within a second (in a daemon thread: a hang
    cannot hold the test run)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn(*args, **kwargs))
        except Exception as e:  # handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    start = time.perf_counter()
    t.start()
    t.join(timeout=5)
    assert not t.is_alive(), f"{fn.__name__} blocked on the target (no answer after 5 s)"
    assert time.perf_counter() - start < 1.0
    return out[0]


# ---------------------------------------------------------------- full disk (RLIMIT_FSIZE)

@needs_limits
@pytest.mark.parametrize(("command", "name"), [
    (["import", DS, "--from", "deepspeed", "-o", "p.toml"], "p.toml"),
    (["export", "mixed_fp16", "--to", "deepspeed", "-o", "ds.json"], "ds.json"),
])
def test_full_disk_cli_leaves_no_partial_file(tmp_path, command, name):
    done = limited(cli(command), 64, tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"file too large (the file size limit, `ulimit -f`) writing {tmp_path / name}; nothing was written" \
        in done.stderr, done.stderr
    assert leftovers(tmp_path) == []  # neither the target nor a temporary file


@needs_limits
def test_full_disk_over_an_existing_file_leaves_it_unchanged(tmp_path):
    (tmp_path / "p.toml").write_text('name = "old"\n')
    done = limited(cli(["import", DS, "--from", "deepspeed", "-o", "p.toml"]), 64, tmp_path)
    assert done.returncode == 1 and "the existing file is unchanged" in done.stderr, done.stderr
    assert (tmp_path / "p.toml").read_text() == 'name = "old"\n' and leftovers(tmp_path) == ["p.toml"]


@needs_limits
def test_full_disk_python_writers_leave_no_partial_file(tmp_path):
    """``unimp.dump`` and ``write_file`` (what ``Tuned.write`` calls): one FileError, no file."""
    body = ("import unimp\nfrom unimp.errors import FileError\n"
            "try:\n    unimp.dump(unimp.load('mixed_fp16'), 'p.toml')\nexcept FileError as e:\n    print(e)\n")
    done = limited(body, 64, tmp_path)
    assert done.returncode == 0 and "dump('p.toml'): file too large" in done.stdout, done
    assert leftovers(tmp_path) == []


@needs_limits
def test_full_disk_watch_stops_with_a_warning_and_its_file_ends_with_a_whole_record(tmp_path):
    """The watch's JSON lines under a file size limit: the record that does not fit is not written (not
    half of it), a warning says so, the watch closes; the records before it are whole lines."""
    body = """
import json, warnings
from unimp.watch import Watch
w = Watch(every=1, path="n.jsonl")
w.bind(0, lambda: None)
layer = ("fc", "output", "float16", 1.5, {"nonfinite": 0, "overflow": 0, "underflow": 0, "subnormal": 0,
                                          "zero": 0, "numel": 4})
with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always")
    for step in range(200):
        if w.closed:
            break
        w.add(step, skipped=False, scale=1024.0, sampled=True, layers=[layer] * 3)
print(json.dumps({"closed": w.closed, "records": len(w.records), "warnings": [str(x.message) for x in ws]}))
"""
    done = limited(body, 1500, tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["closed"] and len(out["warnings"]) == 1, out
    assert "amp.watch(path='n.jsonl'): file too large" in out["warnings"][0] and "the watch stopped" in \
        out["warnings"][0], out
    data = (tmp_path / "n.jsonl").read_bytes()
    assert 0 < len(data) <= 1500 and data.endswith(b"\n")
    lines = data.decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(len(lines)))
    assert len(lines) == out["records"] - 1  # every record but the one that did not fit


# ---------------------------------------------------------------- FIFO and other non-regular targets

@needs_fifo
def test_fifo_target_answers_within_a_second_for_every_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe.toml")
    fifo = tmp_path / "pipe.toml"
    for fn, args in ((write_file, (fifo, "x")), (unimp.dump, (unimp.load("mixed_fp16"), fifo)),
                     (Watch, ()), (AppendLog, (fifo,))):
        kwargs = {"path": fifo} if fn is Watch else {"where": "-o"} if fn in (write_file, AppendLog) else {}
        err = answers_within_a_second(fn, *args, **kwargs)
        assert isinstance(err, FileError) and "is not a regular file (a FIFO, device or socket)" in str(err), (fn, err)


@needs_fifo
def test_fifo_target_of_the_cli_answers_within_a_second(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe")
    for command in (["import", DS, "--from", "deepspeed"], ["export", "mixed_fp16", "--to", "apex"]):
        assert answers_within_a_second(main, [*command, "-o", str(tmp_path / "pipe")]) == 1
        assert f"-o {tmp_path / 'pipe'}: {tmp_path / 'pipe'} is not a regular file" in capsys.readouterr().err


def test_fifo_watch_path_is_a_unimp_error(tmp_path):
    """Bad watch paths are unimp errors (FileError, still a ValueError) naming the argument."""
    with pytest.raises(FileError, match=r"amp.watch\(path='.*'\): is a directory; name a file in it \(e.g. "):
        Watch(path=tmp_path)
    with pytest.raises(FileError, match=r"its directory .*missing does not exist"):
        Watch(path=tmp_path / "missing" / "n.jsonl")


# ---------------------------------------------------------------- replacing and what is kept

def test_replace_existing_file_is_said_and_keeps_permissions(tmp_path, capsys):
    out = tmp_path / "p.toml"
    assert main(["import", DS, "--from", "deepspeed", "-o", str(out)]) == 0
    assert capsys.readouterr().err.startswith(f"wrote {out} (deepspeed, fingerprint ")
    os.chmod(out, 0o640)
    assert main(["import", DS, "--from", "deepspeed", "-o", str(out)]) == 0
    assert capsys.readouterr().err.startswith(f"replaced {out} (deepspeed, fingerprint ")
    assert os.stat(out).st_mode & 0o777 == 0o640 and leftovers(tmp_path) == ["p.toml"]
    assert unimp.load(str(out)).fingerprint == unimp.migrate.import_from("deepspeed", DS).policy.fingerprint


def test_replace_through_a_link_writes_the_file_it_names(tmp_path):
    (tmp_path / "real.toml").write_text("old")
    (tmp_path / "link.toml").symlink_to("real.toml")
    assert write_file(tmp_path / "link.toml", "new", where="-o") is True
    assert (tmp_path / "link.toml").is_symlink() and (tmp_path / "real.toml").read_text() == "new"


def test_export_to_a_file(tmp_path, capsys):
    out = tmp_path / "ds.json"
    assert main(["export", "mixed_fp16", "--to", "deepspeed", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["fp16"]["enabled"] is True and capsys.readouterr().out == ""


def test_an_append_log_keeps_earlier_lines_and_appends(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"step": 0}\n')
    log = AppendLog(path, where="path")
    log.append('{"step": 1}\n')
    log.close()
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'


def test_a_writer_warning_is_an_unimp_warning(tmp_path):
    """A failing writer (a closed log stands for a full disk) stops the watch with an UnimpWarning."""
    w = Watch(every=1, path=tmp_path / "n.jsonl")
    w.bind(0, lambda: None)
    w._writers[0]._log.close()
    with pytest.warns(UnimpWarning, match="the watch stopped at step 0"):
        w.add(0, skipped=False, scale=1.0, sampled=True)
    assert w.closed and not w.sampled(1)
