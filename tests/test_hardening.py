"""Reliability hardening of policy input: bounded work, numeric bounds, duplicate keys, hostile
``extends``, and only located PolicyErrors (issue 14, items 9-12 and 14-18)."""

import json
import math
import os
import struct

import pytest
from bounded import answer, loaded_or_refused, refused
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unimp
from unimp import PolicyError, cli
from unimp.loss_scale import LossScale, f32
from unimp.policy.spec import FLT_MAX, INT32_MAX, MAX_ITEMS, OVERRIDE, TABLES, TOP

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
FIELD_PATHS = ([(k,) for k in TOP] + [(t, k) for t, fields in TABLES.items() for k in fields]
               + [("overrides", 0, k) for k in OVERRIDE])


def at(path, value, doc=None):
    """A policy dict with ``value`` at ``path`` (an override gets a valid rest)."""
    doc = dict(doc or {})
    if path[0] == "overrides":
        doc["overrides"] = [{"modules": ["x"], "compute_dtype": "float32", path[-1]: value}]
    elif len(path) == 1:
        doc[path[0]] = value
    else:
        doc[path[0]] = {path[1]: value}
    return doc


def yaml_path(path):
    """The YAML lines putting ``*bomb`` at ``path``."""
    if path[0] == "overrides":
        return f"overrides:\n  - modules: [x]\n    compute_dtype: float32\n    {path[-1]}: *a9\n"
    if len(path) == 1:
        return f"{path[0]}: *a9\n"
    return f"{path[0]}:\n  {path[1]}: *a9\n"


def alias_bomb(levels=10, width=9):
    lines = [f'a0: &a0 [{", ".join(["lol"] * width)}]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- 9: alias bombs


def test_the_342_byte_alias_bomb_is_refused_quickly(write):
    text = alias_bomb() + "loss_scale:\n  skip_nonfinite: *a9\n"
    assert len(text) < 600  # bytes
    p = write("bomb.yaml", text)
    refused(p, "skip_nonfinite: expected true or false, got a list of 9 items")
    assert answer(cli.main, ["validate", str(p)]) == 1


@SETTINGS
@given(path=st.sampled_from(FIELD_PATHS), width=st.integers(2, 12))
def test_an_alias_bomb_anywhere_is_answered_in_bounds(tmp_path_factory, path, width):
    text = alias_bomb(width=width) + yaml_path(path)
    p = tmp_path_factory.mktemp("bomb") / "bomb.yaml"
    p.write_text(text)
    refused(p)


@SETTINGS
@given(path=st.sampled_from(FIELD_PATHS), width=st.integers(2, 12), as_dict=st.booleans())
def test_a_shared_reference_bomb_through_the_dict_api(path, width, as_dict):
    value = ["x"] * width
    for _ in range(10):  # width**10 leaves, built in microseconds by sharing
        value = {str(i): value for i in range(width)} if as_dict else [value] * width
    refused(at(path, value))


# ---------------------------------------------------------------- 10: huge and quadratic inputs


@pytest.mark.parametrize("n", [10**3, 10**6])
def test_a_million_globs_through_the_dict_api(n):
    doc = {"overrides": [{"modules": [f"m{i}.*" for i in range(n)], "compute_dtype": "float32"}]}
    out = loaded_or_refused(doc)
    if n > MAX_ITEMS:
        assert f"at most {MAX_ITEMS}" in str(out)


@pytest.mark.parametrize("where", ["ops", "types", "modules", "keys", "overrides", "refill"])
def test_a_250_kb_file_of_one_long_list(write, where):
    n = 25_000
    items = ", ".join(f'"x{i}"' for i in range(n))
    text = {"ops": f"[ops]\nlower = [{items}]\n",
            "types": f"[[overrides]]\ntypes = [{items}]\ncompute_dtype = 'float32'\n",
            "modules": f"[[overrides]]\nmodules = [{items}]\ncompute_dtype = 'float32'\n",
            "keys": "[loss_scale]\n" + "".join(f"k{i} = 1\n" for i in range(n)),
            "overrides": "".join("[[overrides]]\nmodules = ['a']\ncompute_dtype = 'float32'\n" for _ in range(5000)),
            "refill": f"[loss_scale]\nhysteresis_refill = [{items}]\n"}[where]
    p = write("long.toml", text[: 256 * 1024 - 100] if where != "keys" else text)
    loaded_or_refused(p)


@SETTINGS
@given(path=st.sampled_from(FIELD_PATHS), n=st.sampled_from([0, 1, 300, 10**4, 10**6]),
       item=st.sampled_from(["matmul", "bogus_op", "Linear", "", 7, None, "x" * 10**4]))
def test_lists_and_tables_of_any_size_anywhere(path, n, item):
    loaded_or_refused(at(path, [item] * n))
    loaded_or_refused(at(path, {f"k{i}": item for i in range(min(n, 10**5))}))
    if path[0] != "overrides":
        loaded_or_refused({path[0]: {f"k{i}": item for i in range(min(n, 10**5))}})


@pytest.mark.parametrize("n", [10, 10**5, 10**7])
def test_strings_of_any_length(n):
    for path in [("name",), ("extends",), ("overrides", 0, "modules"), ("overrides", 0, "types"),
                 ("compute_dtype",), ("ops", "lower")]:
        value = "a" * n if path[-1] not in ("modules", "types", "lower") else ["a" * n]
        loaded_or_refused(at(path, value))


# ---------------------------------------------------------------- 11: deep TOML dotted keys


@pytest.mark.parametrize("shape", ["key", "header", "array_header", "inline", "many"])
def test_deep_toml_dotted_keys_are_refused_before_parsing(write, shape):
    deep = ".".join(["a"] * 20_000)
    text = {"key": f"{deep} = 1\n", "header": f"[{deep}]\n", "array_header": f"[[{deep}]]\n",
            "inline": f"x = {{ {deep} = 1 }}\n",
            "many": "".join(f"{'.'.join(['a'] * 400)}.b{i} = 1\n" for i in range(300))}[shape]
    refused(write("deep.toml", text[: 256 * 1024]), "dotted key")


def test_dotted_keys_a_policy_uses_still_load(write):
    p = write("ok.toml", 'loss_scale.initial = 1024.0\n"ops".lower = ["matmul"]\n'
                         'name = "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r"\n')
    assert unimp.load(p).loss_scale.initial == 1024.0


# ---------------------------------------------------------------- 12: numeric bounds


@pytest.mark.parametrize("key", ["growth_interval", "hysteresis"])
def test_counters_are_bounded_by_int32(key):
    assert getattr(unimp.load({"loss_scale": {key: INT32_MAX}}).loss_scale, key) == INT32_MAX
    refused({"loss_scale": {key: INT32_MAX + 1}}, f"loss_scale.{key}: must be <= {INT32_MAX}")
    refused({"loss_scale": {key: 2**64}}, "int32")


@pytest.mark.parametrize("key", ["initial", "min", "max", "growth_factor"])
def test_scales_are_bounded_by_float32(key):
    doc = {"min": 0.0, "initial": FLT_MAX if key == "min" else 1.0, "max": math.inf}
    ok = unimp.load({"loss_scale": {**doc, key: FLT_MAX}}).loss_scale
    assert math.isfinite(f32(getattr(ok, key)))
    refused({"loss_scale": {**doc, key: 3.5e38}}, "the largest float32")
    refused({"loss_scale": {**doc, key: 10**400}}, "digits")


def test_factors_that_round_to_zero_in_float32_are_refused():
    refused({"loss_scale": {"backoff_factor": 1e-300}}, "smallest float32 (subnormal)")
    refused({"loss_scale": {"initial": 1e-300, "min": 0.0}}, "smallest float32 (subnormal)")


NUMBERS = {(t, k): f for t, fields in TABLES.items() for k, f in fields.items() if f.kind in ("int", "float")}


@SETTINGS
@given(key=st.sampled_from(sorted(NUMBERS)), value=st.one_of(
    st.integers(-2**70, 2**70), st.floats(allow_nan=True),
    st.sampled_from([2**31 - 1, 2**31, FLT_MAX, 3.5e38, 10**400])))
def test_every_number_loads_only_within_its_bounds_and_every_backend_can_hold_it(key, value):
    field = NUMBERS[key]
    base = ({"min": 0.0, "initial": FLT_MAX if key[1] == "min" else 2.0**-126, "max": math.inf}
            if key[0] == "loss_scale" else {"recipe": "delayed"} if key[0] == "fp8" else {})  # amax_history: delayed
    out = loaded_or_refused({key[0]: {**base, key[1]: value}})
    inside = (not (isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not (
        field.allow_inf and value > 0)))) and (field.kind == "float" or isinstance(value, int))
        and ((isinstance(value, float) and math.isinf(value)) or all(ok for ok in [
            field.minimum is None or value >= field.minimum, field.maximum is None or value <= field.maximum,
            field.exclusive_minimum is None or value > field.exclusive_minimum,
            field.exclusive_maximum is None or value < field.exclusive_maximum])))
    if isinstance(out, unimp.Policy):
        assert inside, value
        got = getattr(getattr(out, key[0]), key[1])
        if field.kind == "int":
            assert -(2**31) <= got <= INT32_MAX  # an int32 on device
        elif math.isfinite(got):
            struct.pack("f", got)  # a float32 on device (raises OverflowError if not)
        st0 = LossScale(out.loss_scale).initial_state()
        assert 0 < st0.scale <= FLT_MAX
    else:
        assert not inside or "is above" in str(out), (value, out)  # only a cross-key check (initial > max)


# ---------------------------------------------------------------- 14: duplicate keys, types that match nothing


@pytest.mark.parametrize("name,text", [
    ("d.json", '{"loss_scale": {"initial": 1024.0, "initial": 1e30}}'),
    ("d.json", '{"name": "a", "name": "b"}'),
    ("d.yaml", "loss_scale:\n  initial: 1024.0\n  initial: 1.0e+30\n"),
    ("d.yaml", "name: a\nname: b\n"),
    ("d.toml", 'name = "a"\nname = "b"\n'),
])
def test_duplicate_keys_are_refused_in_every_format(write, name, text):
    refused(write(name, text), "uplicate")


def test_yaml_duplicate_keys_are_located(write):
    assert "line 3, column 3" in str(refused(write("d.yaml", "loss_scale:\n  initial: 1.0\n  initial: 2.0\n")))


@SETTINGS
@given(fmt=st.sampled_from(["json", "yaml"]), key=st.sampled_from(["name", "ops", "loss_scale", "zzz"]),
       n=st.integers(2, 5))
def test_duplicate_keys_property(tmp_path_factory, fmt, key, n):
    d = tmp_path_factory.mktemp("dup")
    body = ", ".join(f'"{key}": {json.dumps("x" if key in ("name", "zzz") else {})}' for _ in range(n))
    p = d / f"d.{fmt}"
    p.write_text("{" + body + "}")  # JSON flow syntax is YAML too
    refused(p, "uplicate key")


@pytest.mark.parametrize("t", [" ", "123", "  Linear", "Linear Layer", "-", "linear!"])
def test_override_types_that_can_match_nothing_are_refused(t):
    refused({"overrides": [{"types": [t], "compute_dtype": "float32"}]}, "matches nothing")


def test_class_names_and_canonical_ops_are_valid_types():
    p = unimp.load({"overrides": [{"types": ["Linear", "BatchNorm2d", "layer_norm"], "compute_dtype": "float32"}]})
    assert p.overrides[0].types == ("Linear", "BatchNorm2d", "layer_norm")


# ---------------------------------------------------------------- 15: hostile extends

SECRET = "s3cr3t-value-from-another-file"


@pytest.fixture
def outside(tmp_path):
    """A policy-looking file outside the project tree, holding a secret in its name."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    (d / "other.toml").write_text(f'name = "{SECRET}"\nbogus_{SECRET} = 1\n')
    (d / "good.toml").write_text('extends = "mixed_fp16"\n')
    proj = tmp_path / "proj" / "sub"
    proj.mkdir(parents=True)
    return d, proj


def hostile_names(d, proj):
    os.symlink(d / "other.toml", proj / "link.toml")
    os.symlink(d, proj / "linkdir")
    return [str(d / "other.toml"), "../../elsewhere/other.toml", "link.toml", "linkdir/other.toml",
            "/proc/self/environ", "/proc/self/status.toml", "../" * 40 + "etc/passwd.toml",
            "/dev/stdin.toml", "/sys/kernel/x.toml"]


def test_hostile_extends_are_refused_without_echoing_the_other_file(outside):
    d, proj = outside
    for name in hostile_names(d, proj):
        (proj / "p.toml").write_text(f"extends = {json.dumps(name)}\n")
        err = refused(proj / "p.toml", "extends")
        assert SECRET not in str(err), (name, str(err))
        err = refused({"extends": name})
        assert SECRET not in str(err)


def test_extends_inside_the_tree_and_opted_in_roots_load(outside, monkeypatch):
    d, proj = outside
    (proj / "inner").mkdir()
    (proj / "inner" / "base.toml").write_text('extends = "mixed_fp16"\n')
    (proj / "p.toml").write_text('extends = "inner/base.toml"\n')
    assert unimp.load(proj / "p.toml").compute_dtype == "float16"
    (proj / "q.toml").write_text(f'extends = "{d / "good.toml"}"\n')
    refused(proj / "q.toml", "extends_roots")
    assert unimp.load(proj / "q.toml", extends_roots=[d]).compute_dtype == "float16"
    monkeypatch.setenv("UNIMP_EXTENDS_ROOTS", str(d))
    assert unimp.load(proj / "q.toml").compute_dtype == "float16"


@SETTINGS
@given(ups=st.integers(1, 6), tail=st.sampled_from(["other.toml", "elsewhere/other.toml", "x/../../other.toml"]),
       absolute=st.booleans(), fmt=st.sampled_from(["toml", "json", "yaml"]), valid=st.booleans())
def test_hostile_extends_property(tmp_path_factory, ups, tail, absolute, fmt, valid):
    root = tmp_path_factory.mktemp("h")
    (root / "elsewhere").mkdir()
    other = f'name = "{SECRET}"\n' + ('extends = "mixed_fp16"\n' if valid else f"bogus_{SECRET} = 1\n")
    (root / "elsewhere" / "other.toml").write_text(other)
    (root / "other.toml").write_text(other)
    proj = root / "a" / "b"
    proj.mkdir(parents=True)
    name = str(root / tail) if absolute else "../" * ups + tail
    p = proj / f"p.{fmt}"
    p.write_text(json.dumps({"extends": name}) if fmt != "toml" else f"extends = {json.dumps(name)}\n")
    out = loaded_or_refused(p)
    assert isinstance(out, PolicyError) and SECRET not in str(out)


def test_a_zero_size_proc_file_does_not_bypass_the_size_cap(tmp_path):
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc")
    link = tmp_path / "status.yaml"
    os.symlink("/proc/self/status", link)  # named by the user: readable, but still at most 256 KB and parsed
    loaded_or_refused(link)
    (tmp_path / "p.toml").write_text('extends = "status.yaml"\n')
    err = refused(tmp_path / "p.toml", "extends may not read proc files")
    assert "VmRSS" not in str(err) and "Name" not in str(err)


# ---------------------------------------------------------------- 16: only PolicyError


@pytest.mark.parametrize("name,text", [
    ("big.toml", "[loss_scale]\ninitial = " + "9" * 400 + "\n"),
    ("big.json", '{"loss_scale": {"initial": ' + "9" * 400 + "}}"),
    ("big.yaml", "loss_scale:\n  growth_interval: " + "9" * 400 + "\n"),
    ("huge.json", '{"loss_scale": {"initial": ' + "9" * 5000 + "}}"),
    ("long.toml", f'extends = "{"x" * 300}"\n'),
    ("long2.toml", f'extends = "{"x" * 300}.toml"\n'),
    ("long3.toml", f'extends = "{"x/" * 600}y.toml"\n'),
    ("nul.json", '{"extends": "a\\u0000b.toml"}'),
    ("deep.json", '{"name": ' + "[" * 50_000 + "]" * 50_000 + "}"),
    ("deep2.json", '{"loss_scale": {"initial": ' + '{"a": ' * 900 + "1" + "}" * 900 + "}}"),
    ("deep.toml", "x = " + "[" * 50_000 + "]" * 50_000 + "\n"),
    ("deep2.toml", "x = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n"),
])
def test_hostile_files_give_only_located_policy_errors(write, name, text):
    p = write(name, text)
    err = refused(p)
    assert str(err).startswith(str(p)), str(err)
    assert answer(cli.main, ["validate", str(p)]) == 1


def test_deeply_nested_values_through_the_dict_api():
    value = 1
    for _ in range(100_000):
        value = {"a": value}
    for path in FIELD_PATHS:
        refused(at(path, value))
    refused({"loss_scale": {"initial": [[[[[[1]]]]]]}}, "a list of 1 items")


def test_the_cli_prints_no_traceback_for_any_of_them(write, capsys):
    p = write("big.toml", "[loss_scale]\ninitial = " + "9" * 400 + "\n")
    assert cli.main(["validate", str(p)]) == 1
    assert "Traceback" not in capsys.readouterr().err


# ---------------------------------------------------------------- 17: surrogates and terminal escapes


@pytest.mark.parametrize("source", [{"name": "a\ud800b"},
                                    {"overrides": [{"modules": ["\udc80"], "compute_dtype": "float32"}]}])
def test_lone_surrogates_are_refused(source):
    refused(source, "surrogate")


def test_a_lone_surrogate_in_a_json_file_is_refused_and_validate_survives(write, capsys):
    p = write("s.json", '{"name": "x\\ud800"}')
    refused(p, "surrogate")
    assert cli.main(["validate", str(p)]) == 1


def test_validate_escapes_terminal_sequences_in_names_and_paths(write, capsys):
    p = write("e\x1b[2Jvil.toml", 'name = "\\u001b]0;pwned\\u0007red\\u001b[31m"\nextends = "mixed_bf16"\n')
    assert cli.main(["validate", str(p)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b" in out
    q = write("f\x1b[31m.toml", 'colour = "\\u001b[31m"\n')
    assert cli.main(["validate", str(q)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "unknown key" in err


# ---------------------------------------------------------------- 18: what a user sees


def test_yaml_syntax_errors_keep_line_and_column(write):
    refused(write("s.yaml", "name: x\nops:\n  lower: [matmul\n  float32: [softmax]\n"), "line 4, column")


def test_a_utf8_bom_is_accepted(write):
    for name, text in [("b.toml", 'name = "bom"\n'), ("b.json", '{"name": "bom"}'), ("b.yaml", "name: bom\n")]:
        assert unimp.load(write(name, b"\xef\xbb\xbf" + text.encode())).name == "bom"


def test_yaml_11_exponent_strings_get_a_hint(write):
    refused(write("e.yaml", "loss_scale:\n  initial: 6.5e4\n"), "6.5e+4")
    refused({"loss_scale": {"initial": "1024"}}, "remove the quotes")


def test_validate_says_how_many_more_problems_there_are(write, capsys):
    p = write("many.toml", "".join(f"bad{i} = 1\n" for i in range(25)))
    assert cli.main(["validate", str(p)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 21 and "... and 5 more problems" in err[-1]


@pytest.mark.parametrize("name", unimp.preset_names())
def test_show_json_is_valid_json_and_loads_back(name, tmp_path, capsys):
    assert cli.main(["show", name, "--format", "json"]) == 0
    text = capsys.readouterr().out
    def no_constants(c):
        raise ValueError(f"not JSON: {c}")

    json.loads(text, parse_constant=no_constants)
    p = tmp_path / "back.json"
    p.write_text(text)
    assert unimp.load(p).fingerprint == unimp.load(name).fingerprint


def test_cli_warnings_are_escaped_too(write, capsys):
    p = write("w\x1b[31m.toml", '[loss_scale]\nmode = "dynamic"\nskip_nonfinite = false\n')
    assert cli.main(["validate", str(p)]) == 0
    err = capsys.readouterr().err
    assert "skip_nonfinite" in err and "\x1b" not in err


def test_an_extends_chain_is_bounded_like_one_file(write):
    filler = "# " + "x" * (100 * 1024) + "\n"
    write("c.toml", 'extends = "mixed_fp16"\n' + filler)
    write("b.toml", 'extends = "c.toml"\n' + filler)
    refused(write("a.toml", 'extends = "b.toml"\n' + filler), "with the files it extends")
    assert unimp.load(write("ok.toml", 'extends = "c.toml"\n')).compute_dtype == "float16"


def test_the_documented_bounds_are_the_spec_table():
    from pathlib import Path

    from unimp.policy.spec import bounds_table

    doc = (Path(__file__).resolve().parent.parent / "docs" / "guarantees.md").read_text()
    assert bounds_table() in doc, "docs/guarantees.md: paste unimp.policy.spec.bounds_table() again"


def test_pipes_and_symlink_loops_are_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "fifo.toml")
    os.symlink(tmp_path / "loop.toml", tmp_path / "loop.toml")
    refused(tmp_path / "fifo.toml", "not a regular file")
    for name in ("fifo.toml", "loop.toml"):
        (tmp_path / "p.toml").write_text(f'extends = "{name}"\n')
        refused(tmp_path / "p.toml", name)


# ---------------------------------------------------------------- issue 32: bad input, the rest

DEEP = "[" * 60000


@pytest.mark.parametrize(("args", "message"), [
    (["import", DEEP, "--from", "deepspeed"], "<argument>: nested too deeply; a DeepSpeed config is a few levels deep"),
    (["import", "{" + '"a":{' * 10000, "--from", "accelerate"], "<argument>: not a JSON table (not valid JSON: "),
    (["import", "mixed_precision: fp16\nGradScalerKwargs: abc", "--from", "accelerate"],
     "<argument>: GradScalerKwargs: expected a table of GradScaler arguments (e.g. init_scale: 1024), got a string "
     "'abc'"),
    (["import", "opt_level=[1]", "--from", "apex"], "<argument>: opt_level: a list of 1 items is not one of O0, O1"),
])
def test_cli_strings_are_refused_like_files(args, message, capsys):
    """The tracebacks of issue 32 (RecursionError, ValueError, TypeError): one located message each."""
    assert answer(cli.main, args) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("importer", ["megatron", "deepspeed"])
def test_python_import_api_has_the_cli_bounds(importer):
    """10**6 Megatron arguments or DeepSpeed keys through the Python API: refused as the CLI refuses them."""
    from unimp.migrate import importers

    big = (["--fp16", *(f"--x{i}" for i in range(10**6))] if importer == "megatron"
           else {"fp16": {"enabled": True}, **{f"k{i}": 1 for i in range(10**6)}})
    err = answer(getattr(importers, importer), big)
    assert isinstance(err, PolicyError) and "over 20000" in str(err), err


def test_python_import_api_refuses_what_is_not_a_command_line():
    from unimp.migrate import importers

    with pytest.raises(PolicyError, match="every argument a string"):
        importers.megatron(["--fp16", 3])


def _reached_trackers(policy):
    """Every growth_tracker the reference rule produces from the initial state (finite steps, one overflow)."""
    rule = LossScale(policy.loss_scale)
    outs = rule.replay([True] * 40 + [False] + [True] * 40)
    return {o.state.growth_tracker for o in outs} | {rule.initial_state().growth_tracker}


@pytest.mark.parametrize(("loss_scale", "bad"), [
    ({"growth_interval": 3}, 3), ({"growth_interval": 3}, 1000),
    ({"growth_interval": 3, "growth_schedule": "interval_plus_one"}, 4),
    ({"mode": "static", "initial": 1024.0}, 1)])
def test_state_dict_the_rule_cannot_reach_is_refused(loss_scale, bad):
    """A growth_tracker the loss-scale rule never produces (issue 32: 1000 with growth_interval 3) is refused
    by the core check every Amp's load_state_dict runs, naming the key and the valid range; the largest the
    rule reaches (by replaying it) loads."""
    from unimp.errors import StateError
    from unimp.loss_scale import LossScaleState

    policy = unimp.load({"extends": "mixed_fp16", "loss_scale": loss_scale})
    reached = _reached_trackers(policy)
    assert bad not in reached
    rule = LossScale(policy.loss_scale)
    top = rule.initial_state().scale
    assert rule.problems(LossScaleState(top, max(reached), policy.loss_scale.hysteresis)) == []
    problems = rule.problems(LossScaleState(top, bad, policy.loss_scale.hysteresis))
    assert len(problems) == 1 and problems[0].startswith(f"growth_tracker: {bad} is out of range 0 to {max(reached)}")
    with pytest.raises(StateError, match=f"growth_tracker: {bad} is out of range"):
        _check_loaded(policy, {"scale": top, "growth_tracker": bad, "hysteresis_left": policy.loss_scale.hysteresis,
                               "skipped": 0, "steps": 0})


def _check_loaded(policy, state):
    """What every Amp's load_state_dict checks of a well-formed state (unimp.backend.Amp.load_state_dict)."""
    from unimp.errors import StateError
    from unimp.loss_scale import LossScaleState, check_state, policy_problems

    problems = check_state(state) or policy_problems(policy.loss_scale, LossScaleState.from_dict(state))
    if problems:
        raise StateError("; ".join(problems))


def test_the_window_schedule_tracker_is_unbounded():
    """DeepSpeed's window tracker is never reset on growth: any int32 count is reachable."""
    from unimp.loss_scale import LossScaleState

    policy = unimp.load("deepspeed_fp16")
    assert LossScale(policy.loss_scale).problems(LossScaleState(65536.0, INT32_MAX, 1)) == []


def test_messages_escape_control_characters_of_names():
    """One escaping helper (unimp.text.printable) in every unimp error, warning and table."""
    from unimp.errors import FileError, StateError, TuneError, UnimpWarning, UnsupportedError
    from unimp.report import format_table

    for cls in (PolicyError, UnsupportedError, TuneError, StateError, FileError, UnimpWarning):
        text = str(cls("layer 'b\x1b[2J':\nfix\x07"))
        assert "\x1b" not in text and "\x07" not in text and "b\\x1b[2J" in text and "\nfix\\x07" in text, cls
    table = format_table(("path",), [("b\x1b[2J",)], title="t\x1b]0;x\x07", footer=["f\x9b"])
    assert not any(c in table for c in "\x1b\x07\x9b") and "b\\x1b[2J" in table
