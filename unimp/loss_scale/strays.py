"""Optimizers that step an applied model's parameters around unimp: when that goes wrong, and the refusal.

Written once for every backend that detects such a step (torch: a global ``torch.optim`` step pre-hook,
``unimp_torch.strays``; Paddle: the dygraph optimizers' update funnel, ``unimp_paddle.strays``). An
optimizer unimp does not wrap, stepping parameters of a model whose loss unimp scales, applies the
*scaled* gradient (the loss scale times the update, never skipped on overflow); where the policy keeps
fp32 master weights, its update of the low-precision copies is overwritten by the next wrapped step. Where
nothing is scaled and there are no masters (``mixed_bf16``), any optimizer steps the model as natively.

>>> at_risk(scaled=False, masters=False), at_risk(scaled=True, masters=False)
(False, True)
>>> print(unwrapped("SGD.step()", "layer.weight", "Linear", "mixed_fp16", True, 65536.0))  # doctest: +ELLIPSIS
SGD.step(): this optimizer steps 'layer.weight' of a Linear under the unimp policy 'mixed_fp16' but ...
"""

from __future__ import annotations

from unimp.errors import UnsupportedError


def at_risk(scaled: bool, masters: bool) -> bool:
    """Whether an optimizer unimp does not wrap steps a model wrongly: its loss is scaled or it has masters."""
    return scaled or masters


#: the fix where an Amp holds several optimizers (torch, Paddle)
ADD = ("pass it to unimp.apply(policy, model, [optimizer, ...]) with the others, or wrap it after apply with "
       "opt = amp.add_optimizer(opt) and step what that returns (after amp.backward(loss))")


def _consequence(scaled: bool, loss_scale: float | None, scaling: str, plain: str) -> str:
    if scaled:
        times = f"loss scale {loss_scale:g} times" if loss_scale is not None else "the loss scale times"
        return (f"after {scaling} its update would be the scaled gradient's ({times} too large), never skipped "
                f"on overflow; after {plain} the policy's loss scaling would not run at all")
    return ("its update would be lost: the model holds low-precision copies of fp32 master weights, "
            "and every wrapped step copies the masters over them")


def unwrapped(verb: str, param: str, model: str, policy: str, scaled: bool, loss_scale: float | None = None, *,
              fix: str = ADD, scaling: str = "amp.backward(loss)",
              plain: str = "a plain loss.backward()") -> UnsupportedError:
    """The refusal of an unwrapped optimizer's ``verb`` (``"SGD.step()"``) that would step ``param`` of a
    ``model`` (its class name) under ``policy``; ``scaled``: the loss is scaled (``loss_scale``: the current
    scale, where it can be read), else the harm is the masters. ``fix``, ``scaling`` (how the backend's user
    scales a loss) and ``plain`` (a backward without it) are in the backend's words."""
    return UnsupportedError(
        f"{verb}: this optimizer steps '{param}' of a {model} under the unimp policy '{policy}' but unimp "
        f"does not wrap it: {_consequence(scaled, loss_scale, scaling, plain)}. Fix: {fix}")


def direct(verb: str, scaled: bool) -> UnsupportedError:
    """The refusal of ``verb`` on an optimizer passed to ``unimp.apply``, stepped around its wrapper."""
    return UnsupportedError(
        f"{verb}: this optimizer was passed to unimp.apply, which wraps it; step the wrapper (amp.optimizer, "
        f"or amp.optimizers[i] with several): stepping it directly would apply "
        + ("the scaled gradients" if scaled else "updates the fp32 masters never get")
        + " without unimp's unscale, skip and master copy")
