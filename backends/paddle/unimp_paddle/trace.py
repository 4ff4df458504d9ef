"""What really ran, from one real run: the dtypes each layer (dygraph, forward hooks) or each canonical op of a
Program (static, fetched variables) produced, as the Report's rows.

>>> import paddle
>>> seen = observe(paddle.nn.Sequential(paddle.nn.Linear(4, 4)), paddle.ones([2, 4]))
>>> seen["0"]
('linear', {'output': 'float32', 'param': 'float32'})
"""

from __future__ import annotations

from typing import Any

from unimp.spi import Plan, ReportRow, UnsupportedError, dtypes, hardware

from .index import layer_kind
from .ops import canonical_of

Seen = dict[str, tuple[str | None, dict[str, str | None]]]


def report_notes(plan: Plan) -> list[str]:
    """The Plan's fallbacks, as the Report lists them."""
    return ([f"Plan fallback: {d.op} runs {d.dtype} ({d.note})" for d in plan.fallbacks]
            + [n for n in plan.notes if n.startswith("fallback:")])


def observe(layer: Any, *inputs: Any, **kw_inputs: Any) -> Seen:
    """Run one forward of ``layer`` with hooks (no grad); per sublayer path its kind and dtypes."""
    import paddle

    seen: Seen = {}
    handles = []
    for path, sub in layer.named_sublayers():
        def hook(sub: Any, _in: Any, out: Any, path: str = path) -> None:
            params = list(sub.parameters(include_sublayers=False))
            first = out[0] if isinstance(out, tuple | list) else out
            seen[path] = (layer_kind(sub), {
                "output": dtypes.dtype_name(first.dtype) if hasattr(first, "dtype") else None,
                "param": dtypes.dtype_name(params[0].dtype) if params else None})
        handles.append(sub.register_forward_post_hook(hook))
    try:
        with paddle.no_grad():
            layer(*inputs, **kw_inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def layer_rows(seen: Seen) -> list[ReportRow]:
    return [ReportRow(path, kind, obs["output"], obs["param"], obs["output"]) for path, (kind, obs) in seen.items()]


def spec(x: Any) -> Any:
    """A tensor as (shape, dtype) to rebuild it for ``amp.report()``; other values as they are."""
    import paddle

    return ("tensor", tuple(x.shape), x.dtype) if isinstance(x, paddle.Tensor) else ("value", x)


def rebuild(s: Any) -> Any:
    """Zeros of a :func:`spec`'s shape and dtype (the value itself for non-tensors)."""
    import paddle

    return paddle.zeros(s[1], dtype=s[2]) if s[0] == "tensor" else s[1]


def program_dtypes(program: Any, executor: Any, feed: dict[str, Any], scope: Any = None) -> list[tuple[str, str, str]]:
    """Run the Program once (a training Program takes a step); ``(op type, output var, dtype)`` per
    canonical op, the dtype being what the fetched variable really held."""
    wanted = [(op.type, op.output_arg_names[0]) for op in program.global_block().ops
              if canonical_of(op.type) and op.output_arg_names and not op.type.endswith("_grad")]
    try:
        values = executor.run(program, feed=feed, fetch_list=[v for _, v in wanted], scope=scope)
    except RuntimeError as e:  # the Plan decided from unimp.hardware; this is the backstop
        if "primitive descriptor" not in str(e):
            raise
        raise UnsupportedError(f"Paddle's oneDNN has no kernel for this bf16 Program on this CPU, "
                               f"{hardware.cpu().describe()}: {str(e).strip().splitlines()[-1]}; set "
                               f"compute_dtype = \"auto\" (float32 where bf16 is not native)") from None
    return [(t, v, dtypes.dtype_name(x.dtype, {"uint16": "bfloat16"})) for (t, v), x in zip(wanted, values)]


def program_rows(ran: list[tuple[str, str, str]]) -> list[ReportRow]:
    return [ReportRow(f"{op}:{var}", canonical_of(op), dtype, "float32", dtype) for op, var, dtype in ran]
