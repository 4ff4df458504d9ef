"""``extends`` opens the file it checked, once: a link swapped in between the check and the open
is refused, not followed (issue 27, item 5: 75 of 3,000 racing loads read another tree's file).

The race window is made deterministic by swapping the file right after unimp's own check
(``unimp.policy.resolve._check_inside``) returns, exactly where a concurrent process could.
"""

import os
import shutil
import threading

import pytest

import unimp
from unimp import PolicyError
from unimp.policy import resolve

SECRET = "s3cr3t-value-from-another-tree"
pytestmark = pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")


@pytest.fixture
def trees(tmp_path):
    """proj/p.toml extends sub/base.toml (inside its tree); elsewhere/ holds another tree's files."""
    other = tmp_path / "elsewhere"
    (other / "sub").mkdir(parents=True)
    secret = f'name = "{SECRET}"\ncompute_dtype = "float16"\n[loss_scale]\nmode = "dynamic"\n'
    (other / "base.toml").write_text(secret)
    (other / "sub" / "base.toml").write_text(secret)
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "sub" / "base.toml").write_text('extends = "mixed_bf16"\n')
    (proj / "p.toml").write_text('extends = "sub/base.toml"\n')
    return proj, other


def swap_after_check(monkeypatch, swap):
    """Run ``swap()`` once, right after the extends check accepted the path (the race window)."""
    check = resolve._check_inside
    done = []

    def checked_then_swapped(*args):
        real = check(*args)
        if not done:
            done.append(swap())
        return real

    monkeypatch.setattr(resolve, "_check_inside", checked_then_swapped)
    return done


def link_file(proj, other):
    os.replace(proj / "sub" / "base.toml", proj / "sub" / "moved.toml")
    os.symlink(other / "base.toml", proj / "sub" / "base.toml")


def link_directory(proj, other):
    shutil.rmtree(proj / "sub")
    os.symlink(other / "sub", proj / "sub")


@pytest.mark.parametrize("swap", [link_file, link_directory])
def test_a_link_swapped_in_after_the_check_is_refused_not_followed(trees, monkeypatch, swap):
    proj, other = trees
    assert unimp.load(proj / "p.toml").compute_dtype == "bfloat16"  # unswapped, it loads
    done = swap_after_check(monkeypatch, lambda: swap(proj, other))
    with pytest.raises(PolicyError, match="changed after extends checked it") as err:
        unimp.load(proj / "p.toml")
    assert done and SECRET not in str(err.value)
    assert (proj / "sub" / "base.toml").resolve().is_relative_to(other)  # the link really was there


def test_the_size_bound_holds_on_the_checked_file(trees):
    proj, _ = trees
    (proj / "sub" / "base.toml").write_text("# pad\n" * (resolve.MAX_FILE_BYTES // 6 + 1))
    with pytest.raises(PolicyError, match="over .* bytes"):
        unimp.load(proj / "p.toml")


def test_racing_links_never_leak_the_other_trees_keys(trees):
    """A thread flips the extended file between a regular file and a link out of the tree."""
    proj, other = trees
    target, stop, leaks, loads = proj / "sub" / "base.toml", threading.Event(), [], 0
    regular = proj / "sub" / "regular.toml"
    regular.write_text('extends = "mixed_bf16"\n')

    def flip():
        while not stop.is_set():
            tmp = proj / "sub" / "tmp.toml"
            os.symlink(other / "base.toml", tmp)
            os.replace(tmp, target)  # atomic: the name is always there
            shutil.copyfile(regular, tmp)
            os.replace(tmp, target)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    try:
        for _ in range(300):
            try:
                policy = unimp.load(proj / "p.toml")
            except PolicyError as e:
                leaks += [e] if SECRET in str(e) else []
                continue
            loads += 1
            if policy.name == SECRET or policy.compute_dtype != "bfloat16":
                leaks.append(policy)
    finally:
        stop.set()
        flipper.join()
    assert leaks == [] and loads > 0, (leaks, loads)
