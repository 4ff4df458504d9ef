"""Every backend's compiled Plan per preset, as JSON: the per-op control tables a refactor must keep.

Run in each backend's env, once before and once after a change, and diff the files::

    .tox/torch/bin/python tools/plan_tables.py torch --out /tmp/before
    ...                                                 --out /tmp/after
    diff -r /tmp/before /tmp/after

Each preset is compiled without a model and with the backend's conformance probe model (so the per-layer
table and layout findings are included); a preset the backend refuses is recorded with its error.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import unimp
from unimp.conformance.probe import probe_weights

KEYS = ("backend", "compute_dtype", "compute_reason", "ops", "notes", "details", "param_fallback",
        "override_fallbacks", "fp8", "loss_scale", "layers", "layout")


def table(plan: Any) -> dict[str, Any]:
    d = plan.to_dict()
    return {k: d[k] for k in KEYS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("backend")
    ap.add_argument("--out", required=True, type=pathlib.Path)
    a = ap.parse_args(argv)
    backend = unimp.get_backend(a.backend)
    kit = backend.conformance_kit()
    out: dict[str, Any] = {}
    for name in unimp.preset_names():
        for with_model in (False, True):
            key = f"{name}{' +model' if with_model else ''}"
            try:
                policy = unimp.load(name)
                model = kit.build_probe(probe_weights()) if with_model else None
                out[key] = table(backend.compile(policy, model))
            except Exception as e:  # the refusal is part of the table
                out[key] = f"{type(e).__name__}: {e}"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.backend}.json").write_text(json.dumps(out, indent=1, sort_keys=True, default=repr) + "\n")
    print(f"{a.backend}: {len(out)} plans -> {a.out / (a.backend + '.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
