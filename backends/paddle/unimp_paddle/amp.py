"""The dygraph Amp: ``paddle.amp.auto_cast`` with compiled lists, O2 ``decorate``, loss scaling.

>>> import paddle, unimp
>>> model = paddle.nn.Linear(8, 8)
>>> opt = paddle.optimizer.Adam(parameters=model.parameters())
>>> amp = unimp.apply({"extends": "mixed_bf16", "on_unsupported": "fallback"}, model, opt)
>>> loss = amp.model(paddle.ones([2, 8])).mean()
>>> amp.backward(loss); amp.optimizer.step(); amp.optimizer.clear_grad()
False
>>> amp.remove() is model
True
"""

from __future__ import annotations

from typing import Any

from unimp.spi import Amp, LossScaleState, Plan, Report

from . import trace
from .distributed import data_parallel, refuse_data_parallel
from .index import channels_last_findings, layer_kind, model_index
from .iteration import PaddleIteration
from .ops import OpLists
from .optimizer import AmpOptimizer
from .scaler import DeviceLossScale


class PaddleAmp(Amp):
    """A policy bound to one ``paddle.nn.Layer`` (+ its optimizers: one, or a list sharing one loss scale)."""

    def __init__(self, plan: Plan, model: Any, optimizer: Any = None) -> None:
        import paddle

        if not isinstance(model, paddle.nn.Layer):
            raise TypeError(f"unimp.apply: model must be a paddle.nn.Layer, got {type(model).__name__}")
        refuse_data_parallel(model)
        inners = list(optimizer) if isinstance(optimizer, list | tuple) else [] if optimizer is None else [optimizer]
        for i, opt in enumerate(inners):
            _check_optimizer(opt, f"unimp.apply: optimizer[{i}]" if len(inners) > 1 else "unimp.apply: optimizer")
        owned = _owned_params(model, inners, "unimp.apply")
        optimizer = inners[0] if inners else None
        if not plan.layers:  # compiled without the model: index it once
            plan = plan.with_index(model_index(model))
        super().__init__(plan, model, optimizer)
        self._last_call: tuple[tuple, dict] | None = None  # shapes/dtypes of the last forward's inputs
        self._watching: Any = None  # unimp_paddle.watch.PaddleWatch while amp.watch() runs
        self._layer = model  # the user's layer (amp.model becomes the DataParallel after data_parallel())
        self._dp: Any = None
        d = plan.details
        self.active: bool = d.amp_active
        self.level: str = d.level
        self.amp_dtype: str = d.amp_dtype
        self.lists: OpLists = d.lists
        self.findings += self.plan.layout.act("paddle", stacklevel=4)
        if self.plan.channels_last:
            self.findings += channels_last_findings(model)
        self._saved = {k: (v.dtype, v.numpy().copy()) for k, v in model.state_dict().items()}
        self._guards = self._layer_guards(model)
        self.native: dict[str, Any] = {"auto_cast": self._auto_cast_args(self.lists), "decorate": None,
                                       "layers": {path: self._guards[id(layer)] for path, layer in
                                                  model.named_sublayers() if id(layer) in self._guards}}
        if self.active and self.level == "O2":
            self._decorate(model, inners if len(inners) > 1 else optimizer)
        self._wrapped = self._wrap_forwards(model)
        params = [p for p in model.parameters() if not p.stop_gradient]
        place = params[0].place if params else None
        self.scaler = DeviceLossScale(plan.loss_scale, place)
        self.iteration = PaddleIteration(self.scaler)
        self._scaling = plan.loss_scale.mode != "none"
        # one optimizer checks every trainable parameter (as before); several, each its own parameters
        self.optimizers = [AmpOptimizer(opt, self.scaler, params if len(inners) == 1 else own, self.iteration)
                           for opt, own in zip(inners, owned, strict=True)]
        self.optimizer = self.optimizers[0] if self.optimizers else None
        self._guard()

    def _guard(self) -> None:
        """Refuse optimizers that step this layer around unimp (:mod:`unimp_paddle.strays`)."""
        from . import strays

        for opt in self.optimizers:
            opt.masters = self.masters
        strays.watch(self)

    @property
    def masters(self) -> bool:
        """Whether the optimizers keep fp32 masters of low-precision parameters (O2 ``decorate``, ``master_weight``)."""
        return self.active and self.level == "O2" and self.plan.master_weights.enabled
    # ------------------------------------------------------------------ setup
    def _auto_cast_args(self, lists: OpLists, low: str | None = None) -> dict[str, Any]:
        from paddle.amp import amp_lists

        low = low if low in ("float16", "bfloat16") else self.amp_dtype
        dtype = low if low != "float32" else "bfloat16"
        white, black = lists.exact(amp_lists.white_list()[dtype][self.level],
                                   amp_lists.black_list()[dtype][self.level])
        return {"enable": self.amp_dtype != "float32", "custom_white_list": sorted(white),
                "custom_black_list": sorted(black), "level": self.level, "dtype": dtype}

    def _layer_guards(self, model: Any) -> dict[int, dict[str, Any]]:
        """auto_cast arguments for layers whose decision differs from the op-level lists."""
        out = {}
        for path, layer in model.named_sublayers():
            kind = layer_kind(layer)
            d = self.plan.decide(path, kind, (type(layer).__name__,))
            if d.override is None and kind != "linear":  # op-level lists decide (or it follows its inputs)
                continue
            moved = self.lists.moved(kind if kind != "linear" else "matmul", d.compute_dtype)
            if d.override is None and moved == self.lists:
                continue
            out[id(layer)] = self._auto_cast_args(moved, d.compute_dtype)  # an override's own dtype
        return out

    def _decorate(self, model: Any, optimizer: Any) -> None:
        import paddle

        keep = [layer for path, layer in model.named_sublayers()
                if self.plan.decide(path, layer_kind(layer), (type(layer).__name__,)).param_dtype
                == "float32" and list(layer.parameters(include_sublayers=False))]
        args = {"level": "O2", "dtype": self.amp_dtype, "master_weight": self.plan.master_weights.enabled,
                "excluded_layers": keep or None}
        self.native["decorate"] = {**args, "excluded_layers": [type(k).__name__ for k in keep]}
        paddle.amp.decorate(models=model, optimizers=optimizer, **args)

    def _wrap_forwards(self, model: Any) -> list[tuple[Any, Any]]:
        wrapped = []
        for _path, layer in [("", model), *model.named_sublayers()]:
            args = self.native["auto_cast"] if layer is model else self._guards.get(id(layer))
            if args is None:
                continue
            had = "forward" in layer.__dict__
            original = layer.forward
            layer.forward = self._forward(original, args, layer is model)
            wrapped.append((layer, original if had else None))
        return wrapped

    def _forward(self, original: Any, args: dict[str, Any], top: bool) -> Any:
        import paddle

        out_dtype = self.plan.output_cast  # None: "unchanged", as auto_cast leaves the outputs
        want = getattr(paddle, out_dtype) if out_dtype else None
        white, black = _list_sets(args)
        call = _call_args(args)
        exact = _needs_exact_lists(call, white, black)
        tracer_of = paddle.base.framework._dygraph_tracer
        auto_cast = paddle.amp.auto_cast

        def forward(*a: Any, **kw: Any) -> Any:
            if top:  # what amp.report() replays: the shapes and dtypes of this call's inputs
                self._last_call = (tuple(map(trace.spec, a)), {k: trace.spec(x) for k, x in kw.items()})
            # paddle.amp.auto_cast(**args) for the per-step path: the list sets built once,
            # auto_cast given only the differences from Paddle's defaults (its _update_list scans
            # custom lists element by element); the tracer then gets exactly ``args``' lists.
            with auto_cast(**call):
                if exact:  # some canonical op Paddle lists by default is gray in the policy
                    tracer_of()._set_amp_op_list(white, black)
                out = original(*a, **kw)
            if top and want is not None and getattr(out, "dtype", want) != want and out.is_floating_point():
                out = out.astype(out_dtype)
            return out

        return forward

    # ------------------------------------------------------------------ verbs
    def backward(self, loss: Any) -> None:
        """``loss.backward()`` on the loss times the current scale (when scaling is on)."""
        self.scale_loss(loss).backward()

    def data_parallel(self, **kwargs: Any) -> Any:
        """``paddle.DataParallel(layer, **kwargs)`` in Paddle's order (after decorate), under the policy.

        Sets and returns ``amp.model``; ``amp.optimizer.step()`` then agrees the non-finite decision
        across ranks and all-reduces gradients in ``plan.reduce_dtype``
        (:mod:`unimp_paddle.distributed`). ``amp.remove()`` returns the plain layer.
        """
        return data_parallel(self, **kwargs)

    def add_optimizer(self, optimizer: Any) -> AmpOptimizer:
        """Wrap one more optimizer of this layer; returns the wrapper to step (``amp.optimizers[-1]``).

        It shares the Amp's loss scale with the others (one update once all of them stepped, as one
        ``paddle.amp.GradScaler`` steps several optimizers) and is unscaled and checked on its own parameters.
        Under O2 with master weights it keeps fp32 masters, as ``paddle.amp.decorate(optimizers=...)`` sets.

        >>> import paddle, unimp
        >>> m = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 2))
        >>> amp = unimp.apply({"extends": "paddle_o1", "on_unsupported": "fallback"}, m,
        ...                   paddle.optimizer.SGD(0.1, parameters=m[0].parameters()))
        >>> head = amp.add_optimizer(paddle.optimizer.SGD(0.1, parameters=m[1].parameters()))
        >>> amp.optimizers[-1] is head, len(amp.optimizers)
        (True, 2)
        >>> _ = amp.remove()
        """
        from paddle.amp.auto_cast import _set_multi_precision

        self._check_live("amp.add_optimizer()")
        if isinstance(optimizer, AmpOptimizer) or any(optimizer is o.inner for o in self.optimizers):
            raise ValueError("amp.add_optimizer(optimizer): this optimizer is already wrapped by unimp (it is in "
                             "amp.optimizers); step that wrapper")
        _check_optimizer(optimizer, "amp.add_optimizer(optimizer): optimizer")
        if self._dp is not None:
            raise ValueError("amp.add_optimizer(optimizer): amp.data_parallel() already set up the optimizers' "
                             "gradient reduction; add every optimizer first, then call amp.data_parallel()")
        owned = _owned_params(self._layer, [o.inner for o in self.optimizers] + [optimizer], "amp.add_optimizer")
        if self.masters:
            _set_multi_precision(optimizer, True)
        for opt, own in zip(self.optimizers, owned, strict=False):
            opt.own(own)  # one optimizer checked every trainable parameter: now each its own
        wrapped = AmpOptimizer(optimizer, self.scaler, owned[-1], self.iteration)
        self.optimizers.append(wrapped)
        if self.optimizer is None:
            self.optimizer = wrapped
        self._guard()  # its optimizers changed: checked again
        return wrapped

    def update(self) -> None:
        """End the iteration: the loss scale updated from the optimizers that stepped since the last update
        (``paddle.amp.GradScaler.update()``). Needed only when not every optimizer steps every iteration:
        otherwise the update runs by itself after the last of them stepped (:mod:`unimp.loss_scale.iteration`)."""
        self._check_live("amp.update()")
        self.iteration.update()
        self.iteration.notify()  # the iteration's end (amp.watch())

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state (:meth:`unimp.Amp.state_dict`), between iterations (refused mid-iteration)."""
        self._check_live("amp.state_dict()")
        self.iteration.refuse_pending("amp.state_dict()")
        return super().state_dict()

    def scale_loss(self, loss: Any) -> Any:
        """The loss times the current loss scale (for custom loops)."""
        if self._watching is not None:
            self._watching.loss(loss)
        if not self._scaling:
            return loss
        scale = self.scaler.scale
        return loss * (scale if loss.dtype == scale.dtype else scale.astype(loss.dtype))

    def _start_watch(self, watch: Any) -> None:
        """``amp.watch(...)`` (the core's): measure for ``watch`` with dygraph hooks (:mod:`unimp_paddle.watch`)."""
        from .watch import PaddleWatch

        PaddleWatch.begin(self, watch, counted=self.optimizer is not None)

    def _tensorboard_writer(self, logdir: Any) -> Any:
        """``amp.watch(tensorboard=logdir)``: records into VisualDL, Paddle's TensorBoard (needs ``visualdl``)."""
        from .watch import visualdl

        return visualdl(logdir)

    # ------------------------------------------------------------------ contract
    def loss_scale_state(self) -> LossScaleState:
        return self.scaler.state()

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        self.scaler.load(state)
        self.iteration.reset()

    def report(self, *inputs: Any, **kw_inputs: Any) -> Report:
        """Per layer: kind, compute/param/output dtype seen in a real forward of ``inputs``.

        Without inputs, a forward of inputs shaped like the last ``amp.model(x)`` call's (zeros of the same
        shapes and dtypes); :class:`~unimp.backend.NoForwardError` before any.
        """
        if not inputs and not kw_inputs:
            if self._last_call is None:
                raise self.no_forward()
            inputs, kw_inputs = (tuple(map(trace.rebuild, self._last_call[0])),
                                 {k: trace.rebuild(s) for k, s in self._last_call[1].items()})
        return self.report_header(trace.layer_rows(self.observe(*inputs, **kw_inputs)), trace.report_notes(self.plan))

    def observe(self, *inputs: Any, **kw_inputs: Any) -> trace.Seen:
        """Run one forward of the layer with hooks; per layer path its kind and dtypes (:func:`trace.observe`)."""
        return trace.observe(self._layer, *inputs, **kw_inputs)

    def __deepcopy__(self, memo: dict[int, Any]) -> PaddleAmp:
        """The copy (:meth:`unimp.Amp.__deepcopy__`) guards its own layer and optimizers
        (:mod:`unimp_paddle.strays`)."""
        new = super().__deepcopy__(memo)
        new._guard()
        return new

    def _restore(self) -> None:
        import paddle

        from . import strays

        strays.unwatch(self)
        if self._dp is not None:
            self._dp.grad_need_sync = True
            self.model = self._layer  # remove() returns the user's layer, not the DataParallel
        for layer, original in self._wrapped:
            if original is None:
                del layer.__dict__["forward"]
            else:
                layer.forward = original
        state = self.model.state_dict()
        if any(state[k].dtype != dtype for k, (dtype, _) in self._saved.items()):
            self.model.float()  # O2 cast params to low precision; all saved floating params were float32
            state = self.model.state_dict()
        with paddle.no_grad():
            for k, (dtype, value) in self._saved.items():
                state[k].set_value(paddle.to_tensor(value, dtype=dtype))


def _check_optimizer(optimizer: Any, where: str) -> None:
    if not hasattr(optimizer, "step"):
        raise TypeError(f"{where} must be a paddle.optimizer.Optimizer (with step()), got {type(optimizer).__name__}")


def _owned_params(model: Any, optimizers: list[Any], verb: str) -> list[list[Any]]:
    """Each optimizer's trainable parameters (its ``_param_groups`` or ``_parameter_list``); a parameter of
    two optimizers, or not of ``model``, is refused naming the optimizer (its index in ``amp.optimizers``)."""
    from .strays import params_of

    own = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}
    out = []
    for i, opt in enumerate(optimizers):
        params = params_of(opt)
        for p in params:
            if id(p) not in own:
                raise ValueError(f"{verb}: optimizer[{i}] holds a parameter ({p.name}) that is not one of this "
                                 f"model's; build each optimizer over this model's parameters")
            if seen.setdefault(id(p), i) != i:
                raise ValueError(f"{verb}: parameter {p.name} is in optimizer[{seen[id(p)]}] and optimizer[{i}]; "
                                 f"each parameter belongs to one optimizer (its gradient is unscaled once per step)")
        out.append([p for p in params if not p.stop_gradient])
    return out


def _list_sets(args: dict[str, Any]) -> tuple[set[str], set[str]]:
    """The white/black sets handed to the tracer (Paddle copies them into the C++ tracer)."""
    return set(args["custom_white_list"]), set(args["custom_black_list"])


def _call_args(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with the custom lists reduced to what differs from Paddle's defaults (as sets)."""
    from paddle.amp import amp_lists

    if not args["enable"]:
        return {**args, "custom_white_list": None, "custom_black_list": None}
    white, black = _list_sets(args)
    d_white = amp_lists.white_list()[args["dtype"]][args["level"]]
    d_black = amp_lists.black_list()[args["dtype"]][args["level"]]
    return {**args, "custom_white_list": white - set(d_white), "custom_black_list": black - set(d_black)}


def _needs_exact_lists(call: dict[str, Any], white: set[str], black: set[str]) -> bool:
    """False when auto_cast(**call) alone already gives the tracer exactly ``white``/``black``."""
    if not call["enable"]:
        return True
    from paddle.amp.auto_cast import _update_list

    got = _update_list(call["custom_white_list"], call["custom_black_list"], call["level"], call["dtype"])
    return (set(got[0]), set(got[1])) != (white, black)
