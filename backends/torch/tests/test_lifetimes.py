"""Lifetimes of applied torch models: sweeps that drop their Amps, collections anywhere, Ctrl-C anywhere.

The patterns: a hyper-parameter sweep (or a notebook cell re-run) that drops each trial's Amp without
``amp.remove()``, so the garbage collector finalizes it whenever it runs, possibly inside unimp's own
critical sections (``op_overrides.acquire`` registering kernels); and a Ctrl-C that lands inside
``unimp.apply``. ipex runs this same code (unimp-ipex builds on unimp-torch's forward and kernels).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import unimp
from unimp.backend import applied
from unimp.conformance.stress import dead_marks, interrupts, sweep, sweep_every_preset
from unimp_torch import op_overrides
from unimp_torch.forward import PolicyForward

# the functions that hold a lock or write the applied marks: collections only there, so a dropped Amp is
# still garbage when one of them runs (as in a sweep whose collections happen to fall there)
CRITICAL = ("acquire", "release", "_drop_released", "__enter__", "__exit__", "claim", "remember")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 8))


def trial(preset: str) -> tuple:
    """One sweep trial: apply, one SGD-with-momentum step; the objects are dropped by the sweep."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp = unimp.apply(preset, model, opt)
    loss = amp.model(torch.randn(4, 8)).float().square().mean()
    amp.backward(loss)
    amp.optimizer.step()
    amp.optimizer.zero_grad()
    return model, opt, amp


def _alive() -> tuple[set[int], dict]:
    """The PolicyForwards alive now (earlier tests' compiled models keep theirs in dynamo's caches) and the
    kernel users they hold."""
    gc.collect()
    return {id(o) for o in gc.get_objects() if isinstance(o, PolicyForward)}, dict(op_overrides._users)


def _assert_all_released(before: tuple[set[int], dict]) -> None:
    """Every Amp the sweep dropped is gone, with its kernels' users and marks: what is left is what was alive
    before it."""
    forwards, _ = _alive()
    assert forwards <= before[0], len(forwards - before[0])
    assert op_overrides._users == before[1] and not op_overrides._released
    assert op_overrides._lib is None or before[1]
    assert not dead_marks()


@pytest.fixture(autouse=True)
def _tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only wait for each other on a busy machine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # misaligned-dims and fallback warnings of the tiny model
            trial("pure_bf16")  # warm up: imports and first-call caches before the sweep freezes the heap
            yield
    finally:
        torch.set_num_threads(threads)


def test_sweep_of_dropped_pure_bf16_amps_with_sgd_momentum_does_not_hang():
    """The reported hang: 200 pure_bf16 trials, SGD with momentum, each Amp dropped without remove(). A
    collection inside ``op_overrides.acquire`` (which held a non-reentrant lock) finalized an earlier Amp,
    whose release waited on that lock in the same thread for ever; now a release never waits."""
    before = _alive()
    gcs = sweep(trial, ["pure_bf16"], 200, seed=1, p=0.1, where=CRITICAL, timeout=60)
    assert gcs.inside["acquire"] > 0  # collections really ran inside the kernels' critical section
    _assert_all_released(before)


def test_sweep_of_dropped_amps_every_preset_cycles_random_collections_and_freezes():
    """The sweep over every preset: model, optimizer and Amp in a reference cycle, collections at random
    points (seen by gc.callbacks inside acquire, claim and the checkpoint patch), gc.freeze() holding dropped
    Amps back then releasing them at once; the kernels go away with the last Amp."""
    before = _alive()
    presets, gcs = sweep_every_preset(trial, seed=2, timeout=90)
    assert len(presets) > 20 and gcs.inside["acquire"] > 0 and gcs.inside["claim"] > 0 and gcs.inside["__enter__"] > 0
    _assert_all_released(before)


def test_ctrl_c_at_any_line_of_apply_bookkeeping_rolls_back():
    """A KeyboardInterrupt at every line unimp's core runs in ``unimp.apply`` (the claim, the snapshot,
    the marks, the final bookkeeping) and in the torch backend's own ``apply``: the model is as before,
    bit for bit, and not marked applied, so ``unimp.apply`` works again."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    files = ("unimp/backend/registry.py", "unimp/backend/applied.py", "unimp/backend/transaction.py",
             "unimp/backend/adapter.py", "unimp/backend/amp.py", "unimp_torch/backend.py")
    where = []
    for at in interrupts(files, lambda: unimp.apply("mixed_bf16", model, opt), lambda amp: amp.remove()):
        where.append(at)
        assert not applied.is_applied(model), at
        assert "forward" not in vars(model) and list(model.parameters()) == params, at
        assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params, strict=True)) and not opt.state, at
        state = model.state_dict()
        assert all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in before.items()), at
    assert len([w for w in where if w]) > 40 and any("registry.py" in w for w in where if w)
    unimp.apply("mixed_bf16", model, opt).remove()
