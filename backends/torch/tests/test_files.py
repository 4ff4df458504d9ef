"""Files whole or not at all on torch (issue 32): ``unimp tune -o`` and the watch of real training steps.

Patterns: *full disk* -- a subprocess with a small ``RLIMIT_FSIZE`` (SIGXFSZ ignored: writes past it get
EFBIG, as a full disk gets ENOSPC); *FIFO* -- a named pipe as the target answers within a second;
*escaped names* -- a module name holding a terminal control sequence is printed escaped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import unimp
from unimp.errors import FileError

ROOT = Path(__file__).resolve().parents[3]
needs_posix = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="RLIMIT_FSIZE and named pipes are POSIX")

FACTORY = '''
import torch
from torch import nn

def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    batches = [torch.randn(8, 16) for _ in range(2)]
    return model, batches, lambda m, x: m(x).float().pow(2).mean()
'''

TRAIN = '''
import json, warnings, torch
from torch import nn
import unimp
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
amp = unimp.apply("mixed_fp16", model, torch.optim.SGD(model.parameters(), lr=0.01))
watch = amp.watch(every=1, path="numerics.jsonl")
losses = []
with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always")
    for _ in range(12):
        loss = amp.model(torch.randn(8, 16)).float().pow(2).mean()
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(loss.item())
print(json.dumps({"closed": watch.closed, "records": len(watch.records), "steps": amp.state_dict()["steps"],
                  "losses": losses, "warnings": [str(w.message) for w in ws if "watch" in str(w.message)]}))
'''


def limited(body: str, limit: int, cwd: Path) -> subprocess.CompletedProcess:
    """``body`` in a fresh interpreter whose files may not grow past ``limit`` bytes."""
    head = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        """)
    paths = [str(ROOT), str(ROOT / "backends" / "torch"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-B", "-c", head + body], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@needs_posix
def test_full_disk_tune_cli_leaves_no_partial_file(tmp_path):
    """``unimp tune -o``: a tuned policy that does not fit is not written at all (it used to be a truncated
    file that validated as the default policy, another fingerprint)."""
    (tmp_path / "script.py").write_text(FACTORY)
    body = ("from unimp.cli import main\n"
            "sys.exit(main(['tune', 'script.py:factory', '--policy', 'mixed_bf16', '--target', 'bf16', "
            "'--max-batches', '2', '-o', 'tuned.toml']))\n")
    done = limited(body, 64, tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"writing {tmp_path / 'tuned.toml'}; nothing was written" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["script.py"]


@needs_posix
def test_full_disk_under_the_watch_stops_it_and_training_goes_on(tmp_path):
    """A watch whose file hits the size limit warns once and stops; every optimizer.step() keeps working
    (it used to raise a raw OSError on each step), and the file holds whole records only."""
    done = limited(TRAIN, 4096, tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["steps"] == 12 and len(out["losses"]) == 12 and all(map(lambda x: x == x, out["losses"]))
    assert out["closed"] and len(out["warnings"]) == 1, out
    assert "file too large" in out["warnings"][0] and "the watch stopped" in out["warnings"][0]
    data = (tmp_path / "numerics.jsonl").read_bytes()
    assert data.endswith(b"\n") and len(data) <= 4096
    lines = data.decode().splitlines()
    assert 0 < len(lines) < out["records"] and [json.loads(line)["step"] for line in lines] == list(range(len(lines)))


@needs_posix
def test_fifo_watch_path_answers_within_a_second(tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    model = nn.Sequential(nn.Linear(8, 8))
    amp = unimp.apply("mixed_fp16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    start = time.perf_counter()
    with pytest.raises(FileError, match=r"amp.watch\(path='.*pipe.jsonl'\): .* is not a regular file"):
        amp.watch(path=tmp_path / "pipe.jsonl")
    assert time.perf_counter() - start < 1.0
    amp.watch(every=1).close()  # nothing was left running: a new watch starts
    amp.remove()


def test_escaped_names_in_the_report_and_the_watch_summary():
    """``model.add_module("b\\x1b[2J", ...)``: report and numerics rows show ``b\\x1b[2J``, never the sequence."""
    model = nn.Sequential()
    model.add_module("a", nn.Linear(8, 8))
    model.add_module("b\x1b[2J", nn.Linear(8, 8))
    amp = unimp.apply("mixed_fp16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    with amp.watch(every=1):
        loss = amp.model(torch.randn(4, 8)).float().sum()
        amp.backward(loss)
        amp.optimizer.step()
    text = str(amp.report())
    assert "\x1b" not in text and text.count("b\\x1b[2J") >= 3  # its report row, its output and gradient rows
    amp.remove()
