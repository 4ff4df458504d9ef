"""`unimp import` on real third-party files, kept verbatim in tests/fixtures/real_configs/<system>/.

Each system's SOURCES.toml names every file's repository, path and commit and the numerics its own
system runs for it (``expect``), each fact citing that system's code (``cite``: file::function).
This test asserts, per file: the imported policy has those facts; nothing in the source is dropped
silently (every key it holds is in the policy file, as a source comment or in the ignored list);
import -> export -> import is the identity where the system can hold the policy; a file the
importer must decline is a located message (``error`` / ``refused``), never a policy.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest

import unimp
from unimp.cli import main
from unimp.errors import UnimpWarning
from unimp.loading import read_file
from unimp.migrate import export_to, import_from
from unimp.migrate.common import effective
from unimp.migrate.corpus import entries, imported, pasted

ROOT = Path(__file__).parent / "fixtures" / "real_configs"
SYSTEMS = ("lightning", "torch", "keras", "tf_keras", "paddle", "jmp", "flax")
HEX40 = re.compile(r"^[0-9a-f]{40}$")


def _configs() -> list[tuple[str, dict[str, Any]]]:
    return [(e["system"], e) for system in SYSTEMS for e in entries(ROOT, system)]


CONFIGS = _configs()


def _id(item: tuple[str, dict[str, Any]]) -> str:
    system, c = item
    return f"{system}:{c['file']}" + (f":{c['lines']}".replace(" ", "") if "lines" in c else "")


def _source(system: str, c: dict[str, Any]) -> str:
    return pasted(ROOT, c)


def test_the_corpus_is_real_and_large_enough():
    assert len({(s, c["file"]) for s, c in CONFIGS}) >= 25
    for system, c in CONFIGS:
        assert (ROOT / system / c["file"]).is_file(), c["file"]
        assert HEX40.match(c["commit"]) and "/" in c["repository"] and c["path"], c
        assert c.get("cite") and all(isinstance(x, str) and ("::" in x or "." in x) for x in c["cite"]), c["file"]
        assert ("expect" in c) != ("error" in c or "refused" in c), c["file"]


@pytest.mark.parametrize("item", CONFIGS, ids=_id)
def test_real_config_imports_to_what_its_system_runs(item, tmp_path, capsys):
    system, c = item
    out = tmp_path / "policy.toml"
    rc = main(["import", _source(system, c), "--from", system, "-o", str(out)])  # warnings go to stderr
    captured = capsys.readouterr()
    if "expect" not in c:
        assert rc == 1 and not out.exists(), captured
        assert c.get("error", c.get("refused")) in captured.err and "Traceback" not in captured.err, captured.err
        return
    assert rc == 0, captured.err
    if "warns" in c:
        assert c["warns"] in captured.err, captured.err
    policy = unimp.load(str(out))
    facts = _facts(policy)
    expect = c["expect"]
    got = {k: facts[k] for k in expect if k != "loss_scale"}
    assert got == {k: v for k, v in expect.items() if k != "loss_scale"}
    ls = expect.get("loss_scale")
    if ls == "none":
        assert policy.loss_scale.mode == "none"
    elif ls is not None:
        assert {k: getattr(policy.loss_scale, k) for k in ls} == ls
    _nothing_dropped(system, c, out.read_text())


def _facts(policy: unimp.Policy) -> dict[str, Any]:
    return {"compute_dtype": policy.compute_dtype, "param_dtype": policy.param_dtype,
            "master_weights": policy.master_weights.enabled, "reduce_dtype": policy.distributed.reduce_dtype,
            "output_dtype": policy.output_dtype, "fp8": policy.fp8.enabled,
            "fp8_recipe": policy.fp8.recipe if policy.fp8.enabled else None}


SECTIONS = ("trainer", "runtime", "AMP")  # sections whose every key the importers read or list


def _nothing_dropped(system: str, c: dict[str, Any], text: str) -> None:
    """Every key of a config file is named in the policy file (a source comment or the ignored list)."""
    if "lines" in c:
        return
    raw = read_file(ROOT / system / c["file"]) if (ROOT / system / c["file"]).suffix in (
        ".yaml", ".yml", ".json") else None
    if not isinstance(raw, dict):
        return
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict) and f"{key} (" not in text:
            for child in value:
                assert f"{key}.{child}" in text, f"{key}.{child} is not in the policy file"
        elif key == "model" and isinstance(value, dict) and "model (" not in text:
            for child in value:
                assert f"model.{child}" in text, f"model.{child} is not in the policy file"
        else:
            assert re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", text), f"{key} is not in the policy file"


@pytest.mark.parametrize("item", [i for i in CONFIGS if "expect" in i[1]], ids=_id)
def test_import_export_import_is_the_identity_where_the_system_holds_it(item):
    system, c = item
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        first = imported(ROOT, c).policy
        out = export_to(system, first)
        if c.get("roundtrip", True) is not True:  # a reason the system cannot hold this policy
            assert out.unexpressed, "listed as not held, but nothing was unexpressed"
            with pytest.raises(unimp.UnsupportedError):
                export_to(system, first, strict=True)
            return
        assert out.unexpressed == (), out.unexpressed
        again = import_from(system, out.config).policy
    assert effective(again) == effective(first)
