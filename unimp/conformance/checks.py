"""The conformance checks: plain functions ``check_xxx(kit, policy)``.

Expected values come from the core (policy, :mod:`unimp.loss_scale`, the numpy probe), never
from the backend under test. A check raises :class:`ConformanceFailure` naming the backend,
the layer/op or step, expected and observed; :class:`NotApplicable` carries the reason.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unimp.backend import NoForwardError, UnimpWarning
from unimp.conformance.expect import expected_layers, expected_output_dtype
from unimp.conformance.kit import Kit
from unimp.conformance.probe import PROBE, probe_batches, probe_weights, reference_forward, reference_loss
from unimp.conformance.select import CHECK_POLICIES
from unimp.conformance.select import reason as tag_reason
from unimp.errors import StateError, UnsupportedError
from unimp.loss_scale import STATE_KEYS, LossScale, LossScaleState
from unimp.plan import Plan
from unimp.policy import Policy
from unimp.policy.loading import load

STANDARD_POLICIES = ("fp32", "mixed_bf16", "pure_bf16", "mixed_fp16", "custom_moved_ops")
CUSTOM_MOVED_OPS = {
    "name": "custom_moved_ops", "extends": "mixed_bf16",
    "ops": {"lower": ["matmul", "conv", "embedding", "log_softmax"],
            "float32": ["linear", "layer_norm", "loss", "reduction", "softmax"]},
    "overrides": [{"modules": ["hea*"], "compute_dtype": "bfloat16"}],
}
POISON_PATTERN = (False, False, True, False, False, False, True, True, False, False, False)
# Stated, not derived: the relative loss gap after up to 10 SGD steps vs the fp32 run of the same probe, both
# sides in one process on one CPU (or the same simulated CPU under hwsim). A per-step bound at the same weights
# (unimp.dtypes.reference_tolerance, as the model suites use) would be tighter; these are 12x (bf16) and 40x
# (fp16) the unit roundoff, loose enough for the trajectory to drift and far below what a wrong dtype gives.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.02}


def loss_tolerance(policy: Policy) -> float:
    """Relative loss tolerance of a policy vs fp32: that of the lowest precision any probe layer or param uses."""
    dtypes = {e.compute_dtype for e in expected_layers(policy).values()} | {policy.param_dtype}
    return max(TOLERANCE.get(d, 1e-4) for d in dtypes)


def close(x: float, y: float, tol: float) -> bool:
    """``x`` within ``tol`` of ``y``, relative to ``max(1, |y|)``."""
    return abs(x - y) <= tol * max(1.0, abs(y))


class ConformanceFailure(AssertionError):
    pass


class NotApplicable(Exception):
    pass


def standard_policy(name: str) -> Policy:
    return load(CUSTOM_MOVED_OPS) if name == "custom_moved_ops" else load(name)


def _fail(kit: Kit, policy: Policy, what: str, expected: Any, observed: Any) -> ConformanceFailure:
    return ConformanceFailure(f"[{kit.backend} / {policy.name}] {what}: expected {expected!r}, "
                              f"observed {observed!r}")


def setup(kit: Kit, policy: Policy, seed: int = 0) -> Any:
    """Fresh probe + optimizer under ``policy``; NotApplicable (after checking the error) if unsupported."""
    model = kit.build_probe(probe_weights(seed))
    opt = kit.make_optimizer(model)
    reason = kit.why_not(policy)
    if reason:
        try:
            amp = kit.apply(policy, model, opt)
        except UnsupportedError as e:
            if len(str(e)) < 20:
                raise _fail(kit, policy, "unsupported error message", "a message naming the fix", str(e)) from e
            raise NotApplicable(f"{reason} (clear UnsupportedError raised)") from None
        amp.remove()
        raise _fail(kit, policy, "apply of an unsupported policy", "UnsupportedError", "it applied")
    return kit.apply(policy, model, opt)


def check_layer_dtypes(kit: Kit, policy: Policy) -> None:
    """Observed compute/param/output dtype of every probe layer = the policy's expectation."""
    amp = setup(kit, policy)
    try:
        observed = kit.observe(amp, probe_batches(1)[0])
        expected = expected_layers(policy, plan=amp.plan)
        for layer in PROBE:
            exp, obs = expected[layer.path], observed.get(layer.path)
            if obs is None:
                raise _fail(kit, policy, f"layer {layer.path}", "an observation", None)
            for f in ("compute_dtype", "output_dtype", "param_dtype"):
                if getattr(obs, f) != getattr(exp, f):
                    raise _fail(kit, policy, f"layer {layer.path} ({layer.kind}) {f}",
                                getattr(exp, f), getattr(obs, f))
    finally:
        amp.remove()


def last_op_lowered(policy: Policy, output_dtype: str) -> Policy:
    """``policy`` with the probe's last op (``log_softmax``) in the ``lower`` list and ``output_dtype``: a
    low-precision last layer, so a cast output and an uncast one differ."""
    last = PROBE[-1].kind
    ops = {name: [o for o in getattr(policy.ops, name) if o != last] for name in ("lower", "float32", "promote")}
    ops["lower"].append(last)
    return policy.replace(name=f"{policy.name}+{last}_lowered+output_{output_dtype}", ops=ops,
                          output_dtype=output_dtype)


def check_output_dtype(kit: Kit, policy: Policy) -> None:
    """The model's output is cast to ``output_dtype``; with ``"unchanged"`` it is in the dtype the last layer
    ran in (nothing casts it). The policy with the last op lowered runs too, both ways: its output must be
    low under ``"unchanged"`` (a backend that casts anyway fails) and cast under ``"float32"``."""
    variants = [policy]
    if policy.compute_dtype != "float32":
        variants += [last_op_lowered(policy, "unchanged"), last_op_lowered(policy, "float32")]
    for i, pol in enumerate(variants):
        try:
            amp = setup(kit, pol)
        except NotApplicable:
            if i == 0:
                raise
            continue  # the counterpart needs a policy this backend refuses (clearly: setup checked it)
        try:
            got = kit.dtype_name(kit.output(amp, probe_batches(1)[0]))
            want = expected_output_dtype(pol, plan=amp.plan)
            if got != want:
                how = (f"output_dtype {pol.output_dtype!r}" if pol.output_cast else
                       f"output_dtype 'unchanged': the last layer ({PROBE[-1].path}) ran in {want}")
                raise _fail(kit, pol, f"model output dtype ({how})", want, got)
        finally:
            amp.remove()


def _bits_equal(low: Any, master: Any, dtype: str) -> bool:
    import numpy as np

    return bool(np.array_equal(np.asarray(low, np.float32), cast_like(master, dtype)))


def cast_like(x: Any, dtype: str) -> Any:
    """float32 numpy -> values representable in ``dtype`` (round to nearest even), as float32."""
    import numpy as np

    x = np.asarray(x, np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32)
    return x


def check_master_weights(kit: Kit, policy: Policy) -> None:
    """fp32 masters exist exactly when params are low precision, and params == cast(master)."""
    amp = setup(kit, policy)
    try:
        for b in probe_batches(3):
            kit.step(amp, b)
        pairs = kit.master_pairs(amp)
        if policy.uses_master_weights and amp.plan.param_fallback == "float32":
            if pairs:
                raise _fail(kit, policy, "master weights", "none (params stay float32 per the Plan)", pairs[0][0])
            return
        if policy.uses_master_weights and not pairs:
            raise _fail(kit, policy, "master weights", "fp32 masters for low-precision params", "none")
        for name, low, master in pairs:
            if str(getattr(master, "dtype", "")) != "float32":
                raise _fail(kit, policy, f"master {name} dtype", "float32", str(master.dtype))
            layer = name.split(".")[0]
            dtype = amp.plan.decide(layer, _kind(layer)).param_dtype
            if not _bits_equal(low, master, dtype):
                raise _fail(kit, policy, f"param {name}", f"cast(master, {dtype})", "different bits")
    finally:
        amp.remove()


def _kind(path: str) -> str | None:
    return next((layer.kind for layer in PROBE if layer.path == path), None)


TRAJECTORY_INITIAL = 256.0  # 11 steps reach at most 256 * 2**6: far below the probe's fp16 overflow


def _trajectory_policy(policy: Policy) -> Policy:
    """The policy with a short growth interval and a scale the probe's fp16 gradients never overflow at."""
    ls = policy.loss_scale
    initial = min(ls.initial, TRAJECTORY_INITIAL)
    return policy.replace(loss_scale={"growth_interval": 2, "initial": initial, "min": min(ls.min, initial)})


def check_loss_scale_trajectory(kit: Kit, policy: Policy) -> None:
    """Scale and skip decisions equal the reference; skipped steps change no bit of state."""
    import numpy as np

    pol = _trajectory_policy(policy)
    pattern = POISON_PATTERN if pol.loss_scale.skip_nonfinite else (False,) * len(POISON_PATTERN)
    rule = LossScale(pol.loss_scale)
    state = rule.initial_state()
    amp = setup(kit, pol)
    try:
        for i, (poison, batch) in enumerate(zip(pattern, probe_batches(len(pattern)), strict=True)):
            before = kit.snapshot(amp)
            kit.step(amp, batch, poison=poison)
            out = rule.update(state, not poison)
            state = out.state
            if amp.scale != state.scale:
                raise _fail(kit, pol, f"loss scale after step {i}", state.scale, amp.scale)
            if amp.skipped_steps != state.skipped:
                raise _fail(kit, pol, f"skipped steps after step {i}", state.skipped, amp.skipped_steps)
            if out.skipped:
                after = kit.snapshot(amp)
                for k, v in before.items():
                    if not np.array_equal(np.asarray(v), np.asarray(after[k]), equal_nan=True):
                        raise _fail(kit, pol, f"state {k} on skipped step {i}", "unchanged", "changed")
    finally:
        amp.remove()


def check_state_dict_roundtrip(kit: Kit, policy: Policy) -> None:
    """``state_dict`` is canonical plain JSON; a fresh Amp loading it continues exactly."""
    pol = _trajectory_policy(policy)
    pattern = POISON_PATTERN if pol.loss_scale.skip_nonfinite else (False,) * len(POISON_PATTERN)
    amp = setup(kit, pol)
    batches = probe_batches(len(pattern))
    try:
        for poison, b in zip(pattern[:5], batches[:5], strict=True):
            kit.step(amp, b, poison=poison)
        sd = json.loads(json.dumps(amp.state_dict()))
    finally:
        amp.remove()
    missing = [k for k in (*STATE_KEYS, "policy_fingerprint", "format") if k not in sd]
    if missing:
        raise _fail(kit, pol, "state_dict keys", "canonical keys", f"missing {missing}")
    amp2 = setup(kit, pol, seed=0)
    try:
        amp2.load_state_dict(sd)
        state = LossScaleState.from_dict(sd)
        if amp2.scale != state.scale:
            raise _fail(kit, pol, "scale after load_state_dict", state.scale, amp2.scale)
        rule = LossScale(pol.loss_scale)
        for i, (poison, b) in enumerate(zip(pattern[5:], batches[5:], strict=True)):
            kit.step(amp2, b, poison=poison)
            state = rule.update(state, not poison).state
            if amp2.scale != state.scale or amp2.skipped_steps != state.skipped:
                raise _fail(kit, pol, f"(scale, skipped) at resumed step {i}",
                            (state.scale, state.skipped), (amp2.scale, amp2.skipped_steps))
    finally:
        amp2.remove()


def check_overrides(kit: Kit, policy: Policy) -> None:
    """Overrides by module glob and by type change exactly the layers they match."""
    other = "float32" if policy.compute_dtype != "float32" else "bfloat16"
    pol = policy.replace(overrides=[{"modules": ["hea*"], "compute_dtype": other},
                                    {"types": ["activation"], "compute_dtype": "float32"}])
    if kit.why_not(pol):
        raise NotApplicable(kit.why_not(pol))
    check_layer_dtypes(kit, pol)


def check_alignment_findings(kit: Kit, policy: Policy) -> None:
    """Dims not a multiple of ``layout.align`` are reported with their paths, as on_misaligned says."""
    pol = policy.replace(layout={"align": 64, "on_misaligned": "error"})
    if kit.why_not(pol):
        raise NotApplicable(kit.why_not(pol))
    try:
        amp = setup(kit, pol)
    except UnsupportedError as e:
        if "fc1" not in str(e) or "head" not in str(e):
            raise _fail(kit, pol, "misaligned error message", "names fc1 and head", str(e)) from e
    else:
        amp.remove()
        raise _fail(kit, pol, "on_misaligned=error", "UnsupportedError", "applied")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = setup(kit, pol.replace(layout={"on_misaligned": "warn"}))
    try:
        text = " ".join(str(w.message) for w in caught if issubclass(w.category, UnimpWarning))
        if "fc1" not in text or "head" not in " ".join(amp.findings):
            raise _fail(kit, pol, "misaligned warning and amp.findings", "fc1 and head named", text)
    finally:
        amp.remove()


def _losses(kit: Kit, policy: Policy, n: int) -> list[float]:
    amp = setup(kit, policy)
    try:
        return [kit.step(amp, b) for b in probe_batches(n)]
    finally:
        amp.remove()


def check_numerics(kit: Kit, policy: Policy) -> None:
    """fp32 first loss = numpy reference; N steps under the policy stay within tolerance of fp32."""
    fp32 = load("fp32")
    base = _losses(kit, fp32, 10)
    ref = reference_loss(reference_forward(probe_weights(0), probe_batches(1)[0]), probe_batches(1)[0])
    if not close(base[0], ref, 1e-4):
        raise _fail(kit, fp32, "first fp32 loss vs the numpy probe", ref, base[0])
    got = _losses(kit, policy, 10)
    tol = loss_tolerance(policy)
    for i, (a, b) in enumerate(zip(got, base, strict=True)):
        if not close(a, b, tol):
            raise _fail(kit, policy, f"loss at step {i} (tolerance {tol})", b, a)


def check_remove_restores(kit: Kit, policy: Policy) -> None:
    """``remove()`` restores params, dtypes and forward exactly; double apply is refused."""
    import numpy as np

    model = kit.build_probe(probe_weights(0))
    opt = kit.make_optimizer(model)
    if kit.why_not(policy):
        raise NotApplicable(kit.why_not(policy))
    batch = probe_batches(1)[0]
    before = kit.model_state(model)
    out_before = kit.forward_fingerprint(model, batch)
    amp = kit.apply(policy, model, opt)
    kit.output(amp, batch)
    try:
        kit.apply(policy, model, opt)
    except RuntimeError as e:
        if "already" not in str(e):
            raise _fail(kit, policy, "double apply message", "says it is already applied", str(e)) from e
    else:
        raise _fail(kit, policy, "second apply on the same model", "RuntimeError", "applied twice")
    restored = amp.remove()
    after = kit.model_state(restored)
    for k, (dtype, value) in before.items():
        if k not in after:
            raise _fail(kit, policy, f"after remove(), {k}", "present", "missing")
        if after[k][0] != dtype or not np.array_equal(after[k][1], value):
            raise _fail(kit, policy, f"after remove(), {k}", dtype, after[k][0])
    out_after = kit.forward_fingerprint(restored, batch)
    if not np.array_equal(np.asarray(out_before), np.asarray(out_after)):
        raise _fail(kit, policy, "forward after remove()", "bit-identical to before apply", "different")
    kit.apply(policy, restored, opt).remove()  # applying again after remove works


def check_amp_surface(kit: Kit, policy: Policy) -> None:
    """The Amp surface is the same everywhere: ``amp.report()`` without inputs reports a forward (before
    any, rows from an example or one :class:`NoForwardError`, never an empty report); after ``amp.model(x)``
    it has a row per probe layer with params; ``state_dict`` is canonical JSON that loads back; after
    ``remove()`` (which returns the model and may run twice) every verb raises :class:`StateError`."""
    amp = setup(kit, policy)
    removed = False
    try:
        try:
            early = amp.report()
        except NoForwardError:
            pass
        else:
            if not early.rows:
                raise _fail(kit, policy, "amp.report() before any forward", "rows or NoForwardError", "no rows")
        kit.output(amp, probe_batches(1)[0])
        rows = {r.path for r in amp.report().rows}
        want = [layer.path for layer in PROBE if layer.params]
        if not set(want) <= rows:
            raise _fail(kit, policy, "amp.report() after amp.model(x)", f"rows for {want}", sorted(rows))
        sd = json.loads(json.dumps(amp.state_dict()))
        if sd.get("format") != "unimp.amp/1" or sd.get("policy_fingerprint") != amp.policy.fingerprint:
            raise _fail(kit, policy, "state_dict format/fingerprint", ("unimp.amp/1", amp.policy.fingerprint),
                        (sd.get("format"), sd.get("policy_fingerprint")))
        amp.load_state_dict(sd)
        model = amp.remove()
        removed = True
        if model is None or amp.remove() is not model:
            raise _fail(kit, policy, "amp.remove() twice", "the same restored model both times", model)
        for verb, call in (("report", amp.report), ("state_dict", amp.state_dict),
                           ("load_state_dict", lambda: amp.load_state_dict(sd)),
                           ("scale", lambda: amp.scale)):
            try:
                call()
            except StateError:
                continue
            raise _fail(kit, policy, f"amp.{verb} after remove()", "StateError", "it ran")
    finally:
        if not removed:
            amp.remove()


def check_loss_scale_follows_plan(kit: Kit, policy: Policy) -> None:
    """The loss scale a backend runs is ``plan.loss_scale``, not the policy's raw knobs: ``auto`` resolved to
    float16 with ``loss_scale.mode = "none"`` runs dynamic scaling (the Plan is forced to float16 here, as
    on a GPU without fast bf16), so the first scale and a poisoned step follow the dynamic rule."""
    pol = policy.replace(compute_dtype="auto", loss_scale={"mode": "none"})
    model = kit.build_probe(probe_weights(0))
    plan = kit.compile(pol, model)
    initial = kit.backend_instance().initial_scale()  # where initial = "auto" starts on this framework
    fp16 = Plan.request(pol, plan.backend).starting_at(initial).at("float16").loss_scale  # auto -> float16
    plan = dataclasses.replace(plan, compute_dtype="float16", loss_scale=fp16)
    if plan.loss_scale.mode != "dynamic":
        raise _fail(kit, pol, "Plan.loss_scale of auto resolved to float16", "dynamic", plan.loss_scale.mode)
    amp = kit.apply_plan(plan, model, kit.make_optimizer(model))
    try:
        rule = LossScale(plan.loss_scale)
        state = rule.initial_state()
        if amp.scale != state.scale:
            raise _fail(kit, pol, "initial loss scale", f"{state.scale} (plan.loss_scale)", amp.scale)
        kit.step(amp, probe_batches(1)[0], poison=True)
        state = rule.update(state, False).state
        if (amp.scale, amp.skipped_steps) != (state.scale, state.skipped):
            raise _fail(kit, pol, "(scale, skipped) after a poisoned step", (state.scale, state.skipped),
                        (amp.scale, amp.skipped_steps))
    finally:
        amp.remove()


def check_auto_policy(kit: Kit, policy: Policy) -> None:
    """``compute_dtype = "auto"`` with an ``auto`` override and a type override: every layer runs in the dtype
    the Plan resolved (a backend deciding a layer without the resolved dtype fails here)."""
    pol = policy.replace(compute_dtype="auto", overrides=[{"modules": ["hea*"], "compute_dtype": "auto"},
                                                           {"types": ["activation"], "compute_dtype": "float32"}])
    if kit.why_not(pol):
        raise NotApplicable(kit.why_not(pol))
    check_layer_dtypes(kit, pol)


CHECKS: tuple[Callable[[Kit, Policy], None], ...] = (
    check_layer_dtypes, check_output_dtype, check_master_weights, check_loss_scale_trajectory,
    check_state_dict_roundtrip, check_overrides, check_alignment_findings, check_numerics,
    check_remove_restores, check_amp_surface, check_loss_scale_follows_plan, check_auto_policy,
)


@dataclass(frozen=True)
class Case:
    check: Callable[[Kit, Policy], None]
    policy: str

    def __str__(self) -> str:
        return f"{self.check.__name__}[{self.policy}]"

    def run(self, kit: Kit) -> None:
        why = tag_reason(kit.tags, self.check.__name__, self.policy)
        if why:
            raise NotApplicable(why)
        self.check(kit, standard_policy(self.policy))


@dataclass(frozen=True)
class Result:
    check: str
    policy: str
    status: str  # pass | n/a | fail
    detail: str = ""


def cases(policies: tuple[str, ...] = STANDARD_POLICIES) -> list[Case]:
    """Every (check, policy) pair, for ``pytest.mark.parametrize`` (a check of one aspect of the Plan runs
    under the policies :data:`unimp.conformance.select.CHECK_POLICIES` names)."""
    return [Case(c, p) for p in policies for c in CHECKS if p in CHECK_POLICIES.get(c.__name__, (p,))]


def run(kit: Kit, policies: tuple[str, ...] = STANDARD_POLICIES) -> list[Result]:
    """Run every check; never raises (failures are results)."""
    out = []
    for case in cases(policies):
        try:
            case.run(kit)
            out.append(Result(case.check.__name__, case.policy, "pass"))
        except NotApplicable as e:
            out.append(Result(case.check.__name__, case.policy, "n/a", str(e)))
        except Exception as e:
            out.append(Result(case.check.__name__, case.policy, "fail", f"{type(e).__name__}: {e}"))
    return out


def check_emulation_warning(caught: list[warnings.WarningMessage], amp: Any, caller: str,
                            dtype: str = "bfloat16") -> None:
    """An explicit ``dtype`` policy warns (at the caller's line ``caller``, naming the fix) exactly
    where :func:`unimp.hardware.cpu` says the CPU emulates ``dtype``, and the Plan's reason agrees."""
    from unimp import hardware

    emulated = [w for w in caught if f"emulates {dtype}" in str(w.message)]
    if hardware.cpu().emulated(dtype):
        assert emulated and all(w.filename == caller for w in emulated), [str(w.message) for w in caught]
        assert 'compute_dtype = "auto"' in str(emulated[0].message) and "emulated" in amp.plan.compute_reason
    else:
        assert not emulated and amp.plan.compute_reason == "as the policy says", amp.plan.compute_reason
