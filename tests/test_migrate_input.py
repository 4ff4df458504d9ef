"""`unimp import` on bad input: one located message (file or argument, key, fix), never a traceback,
never a silent default; and ``python -m unimp`` runs the command."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
