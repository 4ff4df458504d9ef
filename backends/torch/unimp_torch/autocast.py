"""What torch's own autocast does, per device, read from the dispatcher of the running torch.

Whether an aten op has an Autocast kernel on a device is read at runtime
(``torch._C._dispatch_has_kernel_for_dispatch_key``); the kernel's kind follows the canonical op. An op without
a kernel follows its inputs, except binary arithmetic, which torch's type promotion widens.

>>> native_category("softmax", "cuda"), native_category("softmax", "cpu")
('float32', 'inputs')
"""

from __future__ import annotations

import functools

from unimp.spi import PlanRequest, ops

from .ops import NATIVE_OPS

AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

# the cast policy torch registers for an op of each canonical kind (when it registers one)
KERNEL_CATEGORY = {
    "matmul": "lower", "linear": "lower", "conv": "lower", "attention": "lower", "rnn": "lower",
    "activation": "lower",  # prelu
    "embedding": "float32", "softmax": "float32", "log_softmax": "float32", "layer_norm": "float32",
    "rms_norm": "float32", "batch_norm": "float32", "group_norm": "float32", "transcendental": "float32",
    "reduction": "float32", "loss": "float32", "elementwise": "promote", "concat": "promote",
}
TYPE_PROMOTING = frozenset({"add", "sub", "mul", "div", "cat", "stack"})  # torch widens mixed inputs itself
# composite ops whose only floating work runs in ops that autocast already handles on that device
COMPOSITE = {("cross_entropy_loss", "cuda"): "float32",
             **{(n, "cpu"): "lower" for n in ("chain_matmul", "linalg_multi_dot", "lstm_cell", "gru_cell",
                                              "rnn_tanh_cell", "rnn_relu_cell")}}
# ops that exist for one device only (never reached on the other, so never moved there)
DEVICE_ONLY = {"mkldnn_rnn_layer": "cpu", "_native_multi_head_attention": "cpu"}

# torch functions that are not aten ops (or not under that name): the aten op whose autocast handling they get
PY_FUNCTIONS = {"cross_entropy": "cross_entropy_loss", "softmin": "softmax", "normalize": "norm",
                "__matmul__": "matmul", "__pow__": "pow", "__rpow__": "pow", "__rdiv__": "reciprocal",
                "__rtruediv__": "reciprocal"}
# torch functions that run an aten op of another name (``torch.norm``: ``linalg_vector_norm``), moved with them
ATEN_ALIASES = {"norm": ("linalg_vector_norm",)}


def _aten():
    import torch

    return torch.ops.aten


@functools.cache
def aten_names(op: str, device: str | None = None) -> tuple[str, ...]:
    """The public aten operators of canonical ``op`` in this torch (reached on ``device``).

    Internal ``_ops`` are left out: they run beneath a public op, inside its autocast handling.
    """
    aten = _aten()
    out = []
    for name in NATIVE_OPS[op]:
        if name[0].isupper() or name.startswith("_"):
            continue
        if device and DEVICE_ONLY.get(name, device) != device:
            continue
        try:
            getattr(aten, name)
        except (AttributeError, RuntimeError):
            continue
        out.append(name)
    return tuple(out)


@functools.cache
def function_names(op: str, device: str) -> tuple[str, ...]:
    """The torch function names (``func.__name__`` in a ``TorchFunctionMode``) of canonical ``op``."""
    extra = tuple(n for n in NATIVE_OPS[op] if n in PY_FUNCTIONS)
    return aten_names(op, device) + extra


@functools.cache
def overloads(name: str) -> tuple[str, ...]:
    """Qualified overload names (``softmax.int``) of an aten op, without ``out=`` variants."""
    packet = getattr(_aten(), name)
    found = []
    for ov in packet.overloads():
        if "out" in ov.split("_") or ov.endswith("out"):
            continue
        q = name if ov == "default" else f"{name}.{ov}"
        if _has(f"aten::{q}", "CPU") is not None:  # a dispatcher op
            found.append(q)
    return tuple(found)


@functools.cache
def has_kernel(name: str, device: str) -> bool:
    """Whether torch registers an Autocast kernel for any overload of ``name`` on ``device``."""

    key = AUTOCAST_KEYS[device]
    return any(_has(f"aten::{q}", key) for q in overloads(name))


def _has(qualified: str, key: str) -> bool | None:
    """Whether the dispatcher op ``qualified`` has a kernel for ``key``; None: not a dispatcher op."""
    import torch

    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key)
    except RuntimeError:  # a TorchScript-only overload (e.g. aten::tanh.int) is not a dispatcher op
        return None


def canonical_of(name: str) -> str | None:
    return ops.kind_of(name, NATIVE_OPS)


@functools.cache
def native_category(name: str, device: str) -> str:
    """``lower`` | ``float32`` | ``promote`` | ``inputs``: what torch autocast does to aten ``name``."""
    if device not in AUTOCAST_KEYS:
        return "inputs"
    name = PY_FUNCTIONS.get(name, name)
    if (name, device) in COMPOSITE:
        return COMPOSITE[name, device]
    if has_kernel(name, device):
        return KERNEL_CATEGORY.get(canonical_of(name) or "", "float32")
    return "promote" if name in TYPE_PROMOTING else "inputs"


def same(native: str, wanted: str, name: str) -> bool:
    """Whether torch's native handling of ``name`` already gives the ``wanted`` category."""
    if native == wanted:
        return True
    return name in TYPE_PROMOTING and {native, wanted} <= {"promote", "inputs"}


# ops a policy moves with their canonical op even where torch's primary op already does what it asks (CUDA autocast
# runs ``sum`` in float32, ``mean`` in its input dtype) -- except for a policy whose lists are torch's own
ALSO_MOVED = {"reduction": ("mean",)}


def moves(op: str, wanted: str, device: str, torch_own: bool = False, other_low: bool = False) -> tuple[str, ...]:
    """The aten ops of canonical ``op`` whose native handling on ``device`` must change.

    Compared through the primary op (its first aten name): when it already does what the policy asks, torch's
    per-op choices are kept, except for :data:`ALSO_MOVED` unless ``torch_own`` (:func:`is_torch_own`).
    ``other_low``: another low dtype reaches the ops, so torch's promote kernels (which refuse a second low dtype)
    move too.

    >>> moves("reduction", "float32", "cuda"), moves("reduction", "float32", "cuda", torch_own=True)
    (('mean',), ())
    >>> moves("concat", "promote", "cpu"), moves("concat", "promote", "cpu", other_low=True)
    ((), ('cat', 'stack', 'index_copy'))
    """
    names = function_names(op, device)
    candidates: tuple[str, ...]
    if names and same(native_category(names[0], device), wanted, names[0]):
        candidates = () if torch_own else ALSO_MOVED.get(op, ())
    else:
        candidates = names
    differ = [n for n in candidates if not same(native_category(n, device), wanted, n)]
    promoting = [n for n in names if other_low and native_category(n, device) == "promote"
                 and has_kernel(PY_FUNCTIONS.get(n, n), device)]
    return tuple(n for n in names if n in differ or n in promoting)


def is_torch_own(request: PlanRequest, device: str) -> bool:
    """Whether the op lists of ``request`` are torch's own autocast lists on ``device`` (every primary op already
    runs as they ask, or asks float32 for an op of :data:`LATER_KERNELS`): plain ``torch.autocast``.

    >>> import unimp
    >>> from unimp.spi import Plan
    >>> is_torch_own(Plan.request(unimp.load("torch_autocast_cuda"), "torch"), "cuda")
    True
    >>> is_torch_own(Plan.request(unimp.load("mixed_bf16"), "torch"), "cuda")  # batch_norm in float32
    False
    """
    for op in ops.CANONICAL_OPS:
        names, wanted = function_names(op, device), request.op(op).requested
        if names and not same(native_category(names[0], device), wanted, names[0]):
            if (op, device) in LATER_KERNELS and wanted == "float32" and not has_kernel(names[0], device):
                continue  # torch's newer lists, on a torch that predates that kernel
            return False
    return True


# canonical ops whose primary op torch's autocast lists gained from a version on: on an older torch the op follows
# its inputs, and lists asking the newer category are still torch's own (the op is moved, the rest kept)
LATER_KERNELS = {("rms_norm", "cuda"): "2.13"}


def kernel_table(op_moves: dict[str, str], device: str) -> dict[str, str] | None:
    """``op_moves`` (torch function name -> category) as aten op name -> category for unimp's Autocast kernels, or None
    when a kernel cannot carry them: a moved op has a C++ Autocast kernel on ``device`` (a second kernel on that key
    would replace torch's for every caller), or a moved Python-level function's aten op is not moved the same way.

    >>> kernel_table({"softmax": "float32", "softmin": "float32"}, "cpu")
    {'softmax': 'float32'}
    >>> kernel_table({"linear": "float32"}, "cpu") is None
    True
    """
    out = {}
    for name, category in op_moves.items():
        aten = PY_FUNCTIONS.get(name)
        if aten is not None:
            if op_moves.get(aten) != category:
                return None
            continue
        for aten_name in (name, *ATEN_ALIASES.get(name, ())):
            if device not in AUTOCAST_KEYS or has_kernel(aten_name, device):
                return None
            out[aten_name] = category
    return out
