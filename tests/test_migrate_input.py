"""`unimp import` on bad input: one located message (file or argument, key, fix), never a traceback,
never a silent default; and ``python -m unimp`` runs the command."""

from __future__ import annotations

import subprocess
import sys

import pytest

import unimp
from unimp.cli import main


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "big.txt").write_text("--fp16 " + "a" * 400_000)
    (tmp_path / "bin.args").write_bytes(b"--fp16 \xff\xfe\x00")
    return tmp_path


@pytest.mark.parametrize(("args", "message"), [
    (["import", "adir", "--from", "deepspeed"], "adir: is a directory"),
    (["import", "adir", "--from", "megatron"], "adir: is a directory"),
    (["import", "missing.json", "--from", "deepspeed"], "missing.json: no such file"),
    (["import", "big.txt", "--from", "megatron"], "big.txt: over 262144 bytes"),
    (["import", "bin.args", "--from", "megatron"], "bin.args: not UTF-8 text"),
    (["import", "", "--from", "torch"], "empty configuration for --from torch"),
    (["import", " ", "--from", "flax"], "empty configuration for --from flax"),
    (["import", "hello world", "--from", "megatron"], "no Megatron argument found"),
    (["import", "bf16-mixed" + " " * 70_000, "--from", "lightning"], "a pasted configuration is at most 65536"),
])
def test_bad_input_is_located_not_a_default(files, args, message, capsys):
    assert main(args) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_python_dash_m_unimp_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "unimp", "import", "16-mixed", "--from", "lightning"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 'extends = "torch_autocast_cuda"' in out.stdout


# ---------------------------------------------------------------- hostile input (issue 27, items 2 and 3)

BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
BOMB = 'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + BOMB  # 263 bytes -> 9**9 strings
HOSTILE_FILES = {
    "bomb.yaml": BOMB,
    "intkey.yaml": "1: 2\nprecision: 16\n",
    "set.yaml": "precision: !!set {a, b}\n",
    "deep.json": "[" * 60_000,
    "comm.json": '{"communication_data_type": []}',
    "jmp.json": '{"policy": 1}',
    "list.json": "[1, 2, 3]",
    "date.yaml": "precision: 2024-01-01\n",
    "deep.yaml": "a: " + "[" * 5000 + "]" * 5000 + "\n",
}


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in HOSTILE_FILES.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _answer(args, capsys):
    """``main(args)`` within the bounded-work contract (CPU time and memory, tests/bounded.py)."""
    from bounded import answer

    rc = answer(main, args, seconds=2.0)
    assert rc == 1, capsys.readouterr()
    return capsys.readouterr().err


SYSTEMS = ("torch", "lightning", "keras", "tf_keras", "paddle", "jmp", "flax", "deepspeed", "apex", "accelerate",
           "megatron", "paddlenlp")


@pytest.mark.parametrize("system", SYSTEMS)
def test_yaml_alias_bomb_is_refused_fast_for_every_system(hostile, system, capsys):
    err = _answer(["import", "bomb.yaml", "--from", system], capsys)
    assert "bomb.yaml: over 20000 values" in err and "Traceback" not in err, err


@pytest.mark.parametrize(("args", "message"), [
    (["import", "GradScaler(init_scale=10**400)", "--from", "torch"], "init_scale: a power of"),
    (["import", "GradScaler(init_scale=" + "9" * 4299 + "**1100)", "--from", "torch"],
     "init_scale: an integer of over 4000 digits is out of range"),
    (["import", "GradScaler(init_scale=" + "9" * 4299 + ")", "--from", "torch"], "out of range"),
    (["import", "GradScaler(source=1)", "--from", "torch"], "GradScaler.source: unknown argument"),
    (["import", "get_policy(half", "--from", "jmp"], "cannot read 'get_policy(half'"),
    (["import", "GradScaler(init_scale=" + "[" * 60_000 + ")", "--from", "torch"], "cannot read"),
    (["import", "GradScaler(init_scale=" + "+".join(["x"] * 900) + ")", "--from", "torch"],
     "init_scale: 'x+x+x+x+x+x+x+x+x+x+x+x+x+x+x+x+x+x+x+x+'... is not a literal"),
    (["import", "GradScaler(init_scale=" + "+".join(["1"] * 900) + ")", "--from", "torch"], "is not a literal"),
    (["import", "DynamicScale(scale={1, 2})", "--from", "flax"], "scale: a set (2 items)"),
    (["import", "intkey.yaml", "--from", "lightning"], "intkey.yaml: (top level): a key is a string, got an integer 1"),
    (["import", "set.yaml", "--from", "lightning"], "set.yaml: precision: a set (2 items) is not a configuration"),
    (["import", "date.yaml", "--from", "lightning"], "date.yaml: precision: '2024-01-01' is not one of"),
    (["import", "deep.json", "--from", "torch"], "deep.json: not valid JSON: nested too deeply"),
    (["import", "deep.yaml", "--from", "paddle"], "deep.yaml: "),
    (["import", "comm.json", "--from", "deepspeed"], "comm.json: communication_data_type: a list of 0 items is not"),
    (["import", "jmp.json", "--from", "jmp"], "jmp.json: policy: expected a string, got an integer 1"),
    (["import", "list.json", "--from", "megatron"], "list.json: expected a table (a configuration file) or a string"),
    (["import", "list.json", "--from", "keras"], "list.json: expected a table"),
    (["import", "16-mixed", "--from", "lightning", "-o", "/nonexistent/x.toml"],
     "-o /nonexistent/x.toml: its directory /nonexistent does not exist; create it first"),
    (["import", "16-mixed", "--from", "lightning", "-o", "."], "-o .: is a directory; name a file in it"),
    (["import", "16-mixed", "--from", "lightning", "-o", "/dev/full"],
     "-o /dev/full: /dev/full is not a regular file (a FIFO, device or socket)"),
])
def test_hostile_input_is_one_located_message_in_bounded_work(hostile, args, message, capsys):
    if "/dev/full" in args and not __import__("os").path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    err = _answer(args, capsys)
    assert message in err and "Traceback" not in err, err
    assert len(err) < 2000, f"a message of {len(err)} characters quotes a whole value"


INJECTED = {"fp16": {"enabled": True}, 'bs\nparam_dtype = "float16"\n#': 1, "bs\x1b[31mred\x07": 2}


def test_ignored_keys_cannot_inject_settings_or_reach_the_terminal_raw(tmp_path, capsys):
    import json

    import unimp
    from unimp.migrate import import_from

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(INJECTED))
    out = tmp_path / "policy.toml"
    assert main(["import", str(cfg), "--from", "deepspeed", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    reported = import_from("deepspeed", INJECTED).policy
    written = unimp.load(str(out))
    assert written.fingerprint == reported.fingerprint and f"fingerprint {reported.fingerprint}" in err
    assert written.param_dtype == reported.param_dtype
    text = out.read_text()
    assert not any(c in text for c in "\x1b\x07") and text.count("\n") == len(text.splitlines())
    assert "param_dtype" not in "".join(line for line in text.splitlines() if not line.startswith("#"))
    assert main(["import", str(cfg), "--from", "deepspeed"]) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\\x1b[31mred" in shown


def test_a_text_that_does_not_load_back_is_never_written(tmp_path, monkeypatch):
    """The fingerprint check before writing: a renderer that writes another policy is an error."""
    from unimp.migrate import draft, import_from

    real = draft.Draft.render
    monkeypatch.setattr(draft.Draft, "render", lambda self: real(self).replace("growth_interval = 2000",
                                                                                "growth_interval = 1999"))
    out = tmp_path / "p.toml"
    with pytest.raises(unimp.PolicyError, match="loads as fingerprint .* nothing written"):
        import_from("torch", "GradScaler()")
    assert main(["import", "GradScaler()", "--from", "torch", "-o", str(out)]) == 1
    assert not out.exists()


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no named pipes on this system")
@pytest.mark.parametrize("system", ["deepspeed", "megatron", "lightning"])
def test_a_pipe_or_device_is_refused_by_name_never_waited_on(tmp_path, system):
    """A FIFO nobody writes (or ``/dev/zero``) as the source, and a FIFO nobody reads as ``-o``: a located
    error at once -- reading or writing one by name blocks forever (or reads without end)."""
    import os

    os.mkfifo(tmp_path / "pipe")
    os.mkfifo(tmp_path / "pipe.json")
    os.symlink("/dev/zero", tmp_path / "zero.yaml")
    cases = [(["pipe"], "pipe: not a regular file"), (["pipe.json"], "pipe.json: not a regular file"),
             (["zero.yaml"], "zero.yaml: not a regular file"),
             (["16-mixed", "-o", "pipe"], "-o pipe: pipe is not a regular file")]
    if os.path.exists("/dev/zero"):
        cases.append((["/dev/zero"], "/dev/zero: not a regular file"))
    for args, message in cases:
        if "-o" in args and system != "lightning":
            continue
        done = subprocess.run([sys.executable, "-m", "unimp", "import", "--from", system, *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr, (args, done)


def test_paddle_op_names_come_from_the_paddle_backend_and_its_absence_is_named(monkeypatch):
    """The core holds no framework's op names: a Paddle custom list is read with unimp-paddle's own table
    (``PaddleBackend.native_ops``); without that backend it is an error naming the fix, never a guess. A
    config that names no op needs no backend."""
    from unimp.backend import registry
    from unimp.migrate import importers

    table = registry.backends()["paddle"].native_ops
    imp = importers.paddle({"level": "O1", "custom_black_list": list(table["softmax"])})
    assert imp.policy.ops.category("softmax") == "float32"
    monkeypatch.setattr(registry, "backends", lambda: {})
    with pytest.raises(unimp.UnsupportedError, match=r"custom_black_list name Paddle ops.*pip install unimp-paddle"):
        importers.paddle({"level": "O1", "custom_black_list": ["softmax"]})
    assert importers.paddle({"level": "O1"}).policy.compute_dtype == "float16"
