"""Property tests: hostile policies always end in PolicyError, fast; valid policies always load."""

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unimp
from unimp import PolicyError
from unimp.policy.ops import CANONICAL_OPS
from unimp.policy.spec import DEFAULTS, OVERRIDE, TABLES, TOP

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(
    json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12)
field_paths = ([(k,) for k in TOP] + [(t, k) for t, fields in TABLES.items() for k in fields]
               + [("overrides", 0, k) for k in OVERRIDE])


def load_quickly(source):
    t = time.perf_counter()
    try:
        return unimp.load(source)
    finally:
        assert time.perf_counter() - t < 1.0, "load took more than a second"


def set_path(doc, path, value):
    doc = json.loads(json.dumps(doc))
    cur = doc
    for key in path[:-1]:
        if key == "overrides":
            cur = cur.setdefault("overrides", [{"modules": ["x"], "compute_dtype": "float32"}])
        elif isinstance(key, int):
            cur = cur[key]
        else:
            cur = cur.setdefault(key, {})
    cur[path[-1]] = value
    return doc


@SETTINGS
@given(path=st.sampled_from(field_paths), value=json_values)
def test_any_value_anywhere_loads_or_is_a_policy_error(path, value):
    doc = set_path({"name": "p"}, path, value)
    try:
        load_quickly(doc)
    except PolicyError as e:
        assert str(e).startswith("<dict>")


wrong_type = {"str": st.integers() | st.booleans() | st.lists(st.text()), "bool": st.integers() | st.text(),
              "int": st.text() | st.booleans()
              | st.floats(allow_nan=False).filter(lambda f: not math.isfinite(f) or f != int(f)),
              "float": st.text() | st.booleans() | st.lists(st.integers()),
              "enum": st.text().filter(lambda s: s not in ("float16", "bfloat16", "float32", "auto", "none", "static",
                                                           "dynamic", "error", "fallback", "ignore", "warn", "keep",
                                                           "clamp", "interval", "interval_plus_one", "window")),
              "oplist": st.lists(st.text().filter(lambda s: s not in CANONICAL_OPS), min_size=1),
              "strlist": st.integers(), "enumlist": st.lists(st.sampled_from(["nope", "", "growth "]), min_size=1)}


def _field(path):
    if path[0] == "overrides":
        return OVERRIDE[path[-1]]
    return TOP[path[0]] if len(path) == 1 else TABLES[path[0]][path[1]]


@SETTINGS
@given(data=st.data())
def test_wrong_types_and_bad_enums_are_policy_errors(data):
    path = data.draw(st.sampled_from([p for p in field_paths if p[-1] not in ("modules", "types")]))
    value = data.draw(wrong_type[_field(path).kind])
    with pytest.raises(PolicyError):
        load_quickly(set_path({}, path, value))


numeric = [p for p in field_paths if _field(p).kind in ("int", "float")]


@SETTINGS
@given(path=st.sampled_from(numeric), value=st.sampled_from([-1, -1.5, 0, 0.0, float("nan"), -float("inf")]))
def test_bad_numbers_are_policy_errors(path, value):
    f = _field(path)
    if f.minimum == 0 and value in (0, 0.0):
        return  # zero is valid for `min`
    with pytest.raises(PolicyError):
        load_quickly(set_path({}, path, value))


@SETTINGS
@given(key=st.text(min_size=1, max_size=20).filter(lambda k: k not in DEFAULTS and k != "extends"),
       table=st.sampled_from([None, *TABLES]))
def test_unknown_keys_are_policy_errors(key, table):
    doc = {key: 1} if table is None else {table: {key: 1}}
    if table is not None and key in TABLES[table]:
        return
    with pytest.raises(PolicyError, match="unknown key"):
        load_quickly(doc)


@SETTINGS
@given(ops=st.lists(st.sampled_from(CANONICAL_OPS), min_size=1, max_size=5, unique=True),
       lists=st.sampled_from([("lower", "float32"), ("lower", "promote"), ("float32", "promote")]))
def test_op_in_two_lists_is_a_policy_error(ops, lists):
    with pytest.raises(PolicyError, match="already in"):
        load_quickly({"ops": {lists[0]: ops, lists[1]: ops[:1]}})


@SETTINGS
@given(content=st.one_of(st.binary(max_size=400), st.text(max_size=300)),
       suffix=st.sampled_from([".toml", ".yaml", ".json", ".yml"]))
def test_garbage_files_load_or_are_policy_errors(tmp_path, content, suffix):
    p = tmp_path / f"g{suffix}"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    try:
        load_quickly(p)
    except PolicyError:
        pass


@pytest.mark.parametrize("depth", [50, 5000, 100000])
def test_deeply_nested_yaml_and_json(tmp_path, depth):
    (tmp_path / "deep.yaml").write_text("a: " + "[" * depth + "]" * depth)
    (tmp_path / "deep.json").write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    for name in ("deep.yaml", "deep.json"):
        with pytest.raises(PolicyError):
            load_quickly(tmp_path / name)


def test_yaml_alias_bomb(tmp_path):
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [*a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}]"
              for i in range(1, 10)]
    lines += ["ops:", "  lower: *a9"]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines))
    with pytest.raises(PolicyError):
        load_quickly(tmp_path / "bomb.yaml")


def test_a_50_mb_file_is_refused_quickly(tmp_path):
    p = tmp_path / "huge.toml"
    with p.open("wb") as f:
        f.write(b'name = "x"\n# ' + b"x" * (50 * 1024 * 1024) + b"\n")
    with pytest.raises(PolicyError, match="at most"):
        load_quickly(p)


def test_unreadable_file_is_a_policy_error(tmp_path):
    d = tmp_path / "dir.toml"
    d.mkdir()
    with pytest.raises(PolicyError):
        load_quickly(d)


def test_extends_cycles_of_any_length(tmp_path):
    for n in (1, 2, 5):
        for i in range(n):
            (tmp_path / f"c{n}_{i}.toml").write_text(f'extends = "c{n}_{(i + 1) % n}.toml"\n')
        with pytest.raises(PolicyError, match="cycle"):
            load_quickly(tmp_path / f"c{n}_0.toml")


# ---------------------------------------------------------------- no valid policy is rejected

dtype = st.sampled_from(["float16", "bfloat16", "float32"])


@st.composite
def valid_policies(draw):
    ops = list(CANONICAL_OPS)
    draw(st.randoms()).shuffle(ops)
    a, b = sorted(draw(st.lists(st.integers(0, len(ops)), min_size=2, max_size=2)))
    c = draw(st.integers(b, len(ops)))
    mn = draw(st.floats(0, 10, allow_nan=False))
    initial = draw(st.floats(max(mn, 1e-3), 1e6, allow_nan=False))
    mx = draw(st.one_of(st.just(float("inf")), st.floats(initial, 1e30, allow_nan=False)))
    doc = {
        "name": draw(st.text(min_size=1, max_size=10).filter(str.strip)),
        "extends": draw(st.sampled_from(unimp.preset_names())),
        "compute_dtype": draw(st.sampled_from(["float16", "bfloat16", "float32", "auto"])),
        "param_dtype": draw(dtype), "output_dtype": draw(st.one_of(dtype, st.just("unchanged"))),
        "ops": {"lower": ops[:a], "float32": ops[a:b], "promote": ops[b:c]},
        "loss_scale": {"mode": draw(st.sampled_from(["none", "static", "dynamic"])), "initial": initial,
                       "skip_nonfinite": True,
                       "min": mn, "max": mx, "growth_factor": draw(st.floats(1.01, 10)),
                       "backoff_factor": draw(st.floats(0.01, 0.99)), "growth_interval": draw(st.integers(1, 10**6)),
                       "hysteresis": draw(st.integers(1, 10)),
                       "growth_schedule": draw(st.sampled_from(["interval", "interval_plus_one", "window"])),
                       "hysteresis_refill": draw(st.lists(st.sampled_from(["finite", "growth", "backoff"]),
                                                          unique=True))},
        "layout": {"align": draw(st.integers(1, 256)), "channels_last": draw(st.booleans())},
        "overrides": [{"modules": draw(st.lists(st.text(min_size=1, max_size=8).filter(str.strip),
                                                min_size=1, max_size=3, unique=True)),
                       "compute_dtype": draw(dtype)}],
    }
    return doc


@SETTINGS
@given(doc=valid_policies())
def test_valid_policies_load_and_round_trip(tmp_path, doc):
    p = load_quickly(doc)
    assert p.compute_dtype == doc["compute_dtype"]
    for suffix in (".toml", ".json", ".yaml"):
        q = unimp.load(unimp.dump(p, tmp_path / f"rt{suffix}"))
        assert q.fingerprint == p.fingerprint
