"""The ``unimp`` command: validate, show, explain, diff, schema, presets, ops, import, export, tune.

Every failure is one located message per problem and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from unimp.errors import FileError, PolicyError, TuneError, UnsupportedError
from unimp.plan import describe_loss_scale
from unimp.policy.loading import dumps, load, preset_names
from unimp.policy.ops import OPS
from unimp.policy.resolve import flatten
from unimp.policy.spec import json_schema, show
from unimp.report import format_table
from unimp.text import printable


def _say(text: str, file: Any = None) -> None:
    print("\n".join(printable(line) for line in text.split("\n")), file=file or sys.stdout)


def _validate(args: argparse.Namespace) -> int:
    bad = 0
    for f in args.files:
        try:
            p = load(f)
            _say(f"ok  {f}  ({p.name}, fingerprint {p.fingerprint})")
        except PolicyError as e:
            bad += 1
            for line in e.problems:
                _say(line, file=sys.stderr)
    return 1 if bad else 0


def _show(args: argparse.Namespace) -> int:
    print(dumps(load(args.file), args.format), end="")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from unimp.backend.registry import get_backend

    print(get_backend(args.backend).compile(load(args.file)))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from unimp.backend.registry import backends

    a, b = load(args.a), load(args.b)
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    rows = [(k, json.dumps(fa.get(k)), json.dumps(fb.get(k))) for k in sorted({*fa, *fb})
            if k != "name" and fa.get(k) != fb.get(k)]
    print(format_table(("key", a.name, b.name), rows, title=f"policy: {len(rows)} differences"))
    names = [args.backend] if args.backend else sorted(backends())
    for name in names:
        try:
            backend = backends()[name]()
            pa, pb = backend.compile(a), backend.compile(b)
        except (KeyError, UnsupportedError, ImportError) as e:
            print(f"\nbackend {name}: cannot compile ({e})")
            continue
        ops = [(x.op, x.runs_in, y.runs_in) for x, y in zip(pa.ops, pb.ops, strict=True)
               if (x.runs_in, x.honoured) != (y.runs_in, y.honoured)]
        fa8, fb8 = _fp8_summary(pa), _fp8_summary(pb)
        if fa8 != fb8:
            ops.append(("fp8", fa8, fb8))
        sa, sb = describe_loss_scale(pa.loss_scale), describe_loss_scale(pb.loss_scale)
        if sa != sb:  # what runs: e.g. initial = "auto" against a number, equal on one framework, not another
            ops.append(("loss scale", sa, sb))
        print("\n" + format_table(("runs", a.name, b.name), ops,
                                  title=f"backend {name}: {len(ops)} differences in what runs (ops, fp8, loss scale)"))
    return 0


def _fp8_summary(plan: Any) -> str:
    """What a Plan runs in FP8, in one cell: ``off``, ``fallback (...)`` or the recipe, formats and ops."""
    f = plan.fp8
    if f is None or not f.requested:
        return "off"
    if not f.active:
        return "fallback to the compute dtype"
    history = f", history {f.amax_history}" if f.recipe == "delayed" else ""
    return (f"{f.recipe} {f.forward_format}/{f.gradient_format}{history} on {'+'.join(f.ops) or 'overrides'}"
            f" (dims % {f.dims_multiple})")


def _read_source(text: str, system: str | None = None) -> tuple[object, str]:
    """A config file's parsed content (JSON/TOML/YAML; YAML merge keys read) or its text, or ``text``
    itself (a pasted string); a ``.json`` file of a system that reads hjson (DeepSpeed) as its text,
    which that system's importer parses as the system does."""
    import os
    import stat
    from pathlib import Path

    from unimp.migrate import HJSON
    from unimp.policy.resolve import FORMATS, MAX_FILE_BYTES, read_file

    path = Path(text) if text.strip() and len(text) < 4096 and "\n" not in text else None
    try:
        is_file, is_dir = (path.is_file(), path.is_dir()) if path is not None else (False, False)
    except (OSError, ValueError):
        is_file = is_dir = False
    if is_dir:
        raise PolicyError(f"{path}: is a directory; name the configuration file in it")
    if not is_file and path is not None and _exists(path):  # a device, pipe or socket: never read by name
        raise PolicyError(f"{printable(str(path))}: not a regular file (a device, pipe or socket); name a "
                          f"configuration file")
    if not is_file:
        if path is not None and not any(c.isspace() for c in text) and path.suffix.lower() in FORMATS:
            raise PolicyError(f"{path}: no such file (pass an existing file, or the configuration itself)")
        return text, "<argument>"
    assert path is not None  # is_file
    if path.suffix.lower() in FORMATS and not (system in HJSON and path.suffix.lower() == ".json"):
        return read_file(path, merge_keys=True), str(path)
    try:  # non-blocking open + fstat: a pipe or device swapped in after the check cannot hang the read
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise PolicyError(f"{printable(str(path))}: not a regular file; name a configuration file")
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PolicyError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise PolicyError(f"{path}: over {MAX_FILE_BYTES} bytes; a configuration file is at most that")
    try:
        return data.decode("utf-8-sig"), str(path)
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None


def _import(args: argparse.Namespace) -> int:
    from unimp.migrate import import_from
    from unimp.migrate.draft import checked

    if not args.source.strip():  # an unset shell variable, not "the system's defaults"
        raise PolicyError(f"<argument>: empty configuration for --from {args.system}; pass a file or the "
                          f"configuration string (`unimp import --help`)")
    raw, source = _read_source(args.source, args.system)
    imported = import_from(args.system, raw, source, _assume(args.assume))
    if args.output:
        _write(args.output, checked(imported).text, f"{imported.system}, fingerprint {imported.policy.fingerprint}")
    else:
        print(checked(imported).text, end="")
    return 0


def _assume(items: list[str] | None) -> dict[str, Any] | None:
    """``--assume KEY=VALUE`` (repeatable) or ``--assume FILE`` (a JSON/YAML/TOML table, e.g. HF
    TrainingArguments saved with ``to_json_string()``) as one table; None when not given."""
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if eq and key.strip():
            out[key.strip()] = value.strip()
            continue
        raw, _ = _read_source(item)
        if not isinstance(raw, dict):
            raise PolicyError(f"<argument>: --assume {item[:80]!r}: expected KEY=VALUE (e.g. fp16=true) or a "
                              f"file holding a table of Trainer arguments")
        out.update(raw)
    return out


def _exists(path: Any) -> bool:
    """Whether anything (a dangling link included) is at ``path``; False where it cannot be looked at."""
    try:
        return bool(path.is_symlink() or path.exists())
    except (OSError, ValueError):
        return False


def _write(output: str, text: str, what: str) -> None:
    """``text`` to the file ``output``, whole or not at all (:func:`unimp.files.write_file`: a FIFO, device or
    directory refused at once, a full disk one located error and the old file untouched), then one line on
    stderr saying what was written: an existing file is replaced, and the line says so."""
    from unimp.files import write_file

    replaced = write_file(output, text, where=f"<argument>: -o {printable(output[:200])}")
    _say(f"{'replaced' if replaced else 'wrote'} {output} ({what})", file=sys.stderr)


def _export(args: argparse.Namespace) -> int:
    from unimp.migrate import export_to

    into = None
    if args.into is not None:
        into, _ = _read_source(args.into, args.system)
        if not args.into.strip() or (isinstance(into, str) and into == args.into):
            raise PolicyError(f"<argument>: --into {printable(args.into[:200])}: no such file (name the "
                              f"{args.system} configuration file to merge into)")
    exported = export_to(args.system, load(args.policy), strict=args.strict, into=into,
                         into_source=args.into or "<argument>: --into")
    if args.output:
        _write(args.output, exported.text, f"{exported.system} configuration")
    else:
        print(exported.text, end="")
    for line in exported.changed:
        _say(f"changed in {printable(args.into)}: {printable(line)}", file=sys.stderr)
    for line in exported.unexpressed:
        _say(f"not expressed: {line}", file=sys.stderr)
    if into is None and _merges_into(args.system):
        _say(f"only the precision keys are written (the policy holds no ZeRO stage, batch sizes or other "
             f"{args.system} settings); to keep every other key of your configuration, merge into it: "
             f"--into YOUR_CONFIG", file=sys.stderr)
    return 0


def _merges_into(system: str) -> bool:
    """Whether ``unimp export --to system --into FILE`` can merge into the user's file."""
    from unimp.migrate import module

    return hasattr(module(system), "OWNED")


def _factory(spec: str) -> Any:
    """The function ``factory`` of ``SCRIPT.py:factory`` (default name ``factory``), the script run as ``python``
    would run it (its directory first on ``sys.path``)."""
    import importlib.util
    import traceback
    from pathlib import Path

    script, colon, name = spec.rpartition(":") if spec.rpartition(":")[2].isidentifier() else (spec, "", "")
    name = name if colon else "factory"
    path = Path(script)
    where = f"<argument>: {printable(spec[:200])}"
    if path.suffix != ".py" or not path.is_file():
        raise TuneError(f"{where}: expected SCRIPT.py:factory, a Python file and the function in it that returns "
                        f"(model, batches, loss_fn); {printable(script[:200])} is not a .py file")
    loader = importlib.util.spec_from_file_location(f"unimp_tune_{path.stem}", path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    sys.path.insert(0, str(path.resolve().parent))
    try:
        loader.loader.exec_module(module)
    except Exception as e:  # the user's script: its own traceback is what they need
        traceback.print_exc()
        raise TuneError(f"{where}: running {printable(script[:200])} raised {type(e).__name__} (traceback above)") \
            from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    factory = getattr(module, name, None)
    if not callable(factory):
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                   and getattr(v, "__module__", None) == module.__name__]
        raise TuneError(f"{where}: {printable(script[:200])} defines no function {name!r} (it defines: "
                        f"{', '.join(defined[:10]) or 'none'}); name it as SCRIPT.py:function")
    return factory


def _tune(args: argparse.Namespace) -> int:
    import traceback

    from unimp.tuning import tune

    factory = _factory(args.factory)
    policy = load(args.policy)
    try:
        made = factory()
    except Exception as e:  # the user's factory: its own traceback is what they need
        traceback.print_exc()
        raise TuneError(f"<argument>: {printable(args.factory[:200])}: the factory raised {type(e).__name__} "
                        f"(traceback above)") from None
    if not isinstance(made, tuple | list) or len(made) != 3:
        raise TuneError(f"<argument>: {printable(args.factory[:200])} returned {show(made)}; it must return "
                        f"(model, batches, loss_fn): loss_fn(model, batch) gives the batch's loss")
    model, batches, loss_fn = made
    tuned = tune(policy, model, batches, loss_fn, target=args.target, max_loss_increase=args.max_loss_increase,
                 max_output_divergence=args.max_output_divergence, min_speedup=args.min_speedup, layers=args.layers,
                 max_layers=args.max_layers, max_batches=args.max_batches, speed=not args.no_speed,
                 hessian_samples=args.hessian_samples, seed=args.seed, backend=args.backend)
    if args.output:
        _say(str(tuned))
        _write(args.output, tuned.text, f"policy {tuned.policy.name!r}, fingerprint {tuned.policy.fingerprint}")
    else:
        _say(str(tuned), file=sys.stderr)
        print(tuned.text, end="")
    return 0


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0


def _presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        p = load(name)
        fp8 = f" fp8={p.fp8.recipe}" if p.fp8.enabled else ""
        print(f"{name:24} compute={p.compute_dtype:9} params={p.param_dtype:9} "
              f"loss_scale={p.loss_scale.mode}{fp8}")
    return 0


def _ops(args: argparse.Namespace) -> int:
    print(format_table(("op", "meaning"), [(o.name, o.meaning) for o in OPS.values()]))
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="unimp", description="one mixed-precision policy for every framework")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check policy files")
    p.add_argument("files", nargs="+")
    p.set_defaults(run=_validate)
    p = sub.add_parser("show", help="print the resolved policy")
    p.add_argument("file")
    p.add_argument("--format", choices=("toml", "yaml", "json"), default="toml")
    p.set_defaults(run=_show)
    p = sub.add_parser("explain", help="print the Plan of a policy for one backend")
    p.add_argument("file")
    p.add_argument("--backend", required=True)
    p.set_defaults(run=_explain)
    p = sub.add_parser("diff", help="effective differences of two policies, per backend")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--backend")
    p.set_defaults(run=_diff)
    from unimp.migrate import SYSTEMS

    p = sub.add_parser("import", help="a policy file from another system's AMP configuration")
    p.add_argument("source", metavar="FILE|STRING")
    p.add_argument("--from", dest="system", required=True, metavar="SYSTEM", help=", ".join(SYSTEMS))
    p.add_argument("-o", "--output", help="write the policy here instead of printing it (an existing file is "
                                          "replaced, whole)")
    p.add_argument("--assume", action="append", metavar="KEY=VALUE|FILE",
                   help="run arguments that 'auto' values resolve from (DeepSpeed: HF Trainer's fp16, bf16, "
                        "fp16_full_eval, bf16_full_eval, fp16_backend, fp16_opt_level; or a TrainingArguments "
                        "JSON file)")
    p.set_defaults(run=_import)
    p = sub.add_parser("export", help="a policy as another system's AMP configuration")
    p.add_argument("policy")
    p.add_argument("--to", dest="system", required=True, metavar="SYSTEM", help=", ".join(SYSTEMS))
    p.add_argument("--strict", action="store_true", help="fail when the system cannot express a key")
    p.add_argument("--into", metavar="FILE", help="your own config file: print it with only its precision keys "
                                                  "changed (every other key kept as it is)")
    p.add_argument("-o", "--output", help="write the configuration here instead of printing it (an existing file "
                                          "is replaced, whole)")
    p.set_defaults(run=_export)
    p = sub.add_parser("tune", help="a policy file keeping the layers sensitive to lowering high (measured)",
                       description="Run SCRIPT.py's factory() -> (model, batches, loss_fn), measure each layer the "
                                   "policy lowers alone, and write a policy whose overrides keep the sensitive "
                                   "layers high, each with its measurements as a comment.")
    p.add_argument("factory", metavar="SCRIPT.py[:factory]",
                   help="a Python file and its function returning (model, batches, loss_fn) (default: factory)")
    p.add_argument("--policy", required=True, help="the policy to tune (a file or preset name)")
    p.add_argument("-o", "--out", dest="output", help="write the tuned policy here instead of printing it (an "
                                                         "existing file is replaced, whole)")
    p.add_argument("--target", choices=("fp8", "bf16", "fp16"), help="what to lower to (default: what the policy "
                                                                        "lowers to)")
    p.add_argument("--max-loss-increase", type=float, default=0.01, metavar="X",
                   help="largest relative change of the loss a layer alone, and the policy, may cause (0.01)")
    p.add_argument("--max-output-divergence", type=float, metavar="X",
                   help="largest relative change of the outputs one lowered layer may cause (default: what "
                        "rounding to the format explains)")
    p.add_argument("--min-speedup", type=float, default=1.0, metavar="X",
                   help="FP8: keep a layer whose measured GEMM speed-up is below this (1.0)")
    p.add_argument("--layers", action="append", metavar="GLOB", help="only these candidate layers (repeatable)")
    p.add_argument("--max-layers", type=int, default=64, metavar="N", help="refuse more candidate layers (64)")
    p.add_argument("--max-batches", type=int, default=8, metavar="N", help="refuse more batches (8)")
    p.add_argument("--hessian-samples", type=int, default=0, metavar="N",
                   help="Hutchinson Hessian-trace estimate with N vectors per batch (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the Hutchinson vectors (0)")
    p.add_argument("--no-speed", action="store_true", help="do not microbenchmark FP8 GEMMs")
    p.add_argument("--backend", help="the backend (default: detected from the model)")
    p.set_defaults(run=_tune)
    sub.add_parser("schema", help="JSON Schema of the file format").set_defaults(run=_schema)
    sub.add_parser("presets", help="list shipped presets").set_defaults(run=_presets)
    sub.add_parser("ops", help="list canonical ops").set_defaults(run=_ops)
    return ap


def _warn(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    _say(f"warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn  # warnings name files and values too: escaped like the rest
            code: int = args.run(args)
            return code
    except (PolicyError, UnsupportedError, TuneError, FileError) as e:
        _say(str(e), file=sys.stderr)
        return 1
    except BrokenPipeError:  # `unimp presets | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
