"""``TorchAmp``: a policy bound to one ``torch.nn.Module`` (+ its optimizers), and ``bind`` which makes it.

Several optimizers share the Amp's one loss scale (``unimp.apply(policy, model, [opt_a, opt_b])``, or
``amp.add_optimizer(opt)`` later; another Amp joins it with ``share_scale_with=amp``): each is unscaled, checked and
skipped on its own parameters, and the scale is updated once every one of them has stepped, as
``torch.amp.GradScaler``'s ``step(a); step(b); update()`` (:mod:`unimp_torch.iteration`).

>>> import torch, unimp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
>>> amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters()))
>>> loss = amp.model(torch.randn(4, 8)).square().mean()
>>> amp.backward(loss); amp.optimizer.step(); amp.optimizer.zero_grad()
>>> amp.report().row("0").compute_dtype
'bfloat16'
>>> _ = amp.remove()
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from unimp.spi import Amp, Fp8Decision, LossScaleState, Plan, Report, ReportRow

from .casts import DTYPES, output_cast
from .forward import PolicyForward, patch_forward
from .fp8 import Fp8Binding
from .index import model_index
from .integrations.ema import track as track_ema
from .integrations.save_pretrained import save_full_precision
from .iteration import Iteration
from .kinds import kind, type_names
from .layers import Rule, wrap
from .layout import has_conv2d, restore_layout, to_channels_last
from .optimizer import AfterInnerStep, AmpOptimizer
from .params import ParamState, cast_params
from .scaler import DeviceLossScale
from .trace import Observer, example_inputs, is_layer, observe
from .validate import as_list, check_optimizers, first_device


class TorchAmp(Amp):
    """The handle :func:`unimp.apply` returns for torch models."""

    def __init__(self, plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 device: str, shared: TorchAmp | None = None) -> None:
        super().__init__(plan, model, optimizer)
        self.device = device
        self.module = model  # the user's module itself (amp.model may be its DDP wrapper)
        self.inner_optimizer = optimizer
        self.optimizers: list[AmpOptimizer] = []  # the wrapped optimizers; amp.optimizer is the first
        self.on_skip: Callable[[], Any] | None = None
        # one loss scale for every optimizer of the iteration (this Amp's, and those of Amps sharing it)
        self.scaler: DeviceLossScale = (shared.scaler if shared is not None
                                        else DeviceLossScale(plan.loss_scale, first_device(model)))
        self.iteration: Iteration = shared.iteration if shared is not None else Iteration(self.scaler)
        self.params = ParamState()
        self.wrapped: list[str] = []  # module paths with a layer-level forward
        self._undo: list[Callable[[], None]] = []
        self._layout: list[tuple[torch.Tensor, tuple[int, ...]]] = []  # (param, original strides)
        self._observer = Observer()  # filled by the first eager forward after apply
        # set when data-parallel or sharded (unimp_torch.distributed); ``agree(found_inf)`` all-reduces it (MAX)
        self.distributed: dict[str, Any] | None = None
        self.agree: Callable[[torch.Tensor], None] | None = None
        self.fp8: Fp8Binding | None = None  # the layers running FP8 (unimp_torch.fp8), when the Plan has FP8
        self._watching: Any = None  # unimp_torch.watch.TorchWatch while amp.watch() runs

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` on the scaled loss (call several times to accumulate)."""
        self._check_live("amp.backward()")
        self.check_loss_dtype(str(loss.dtype).removeprefix("torch."))
        self._scaled(loss, "amp.backward()").backward(**kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._check_live("amp.scale_loss()")
        return self._scaled(loss, "amp.scale_loss()")

    def _scaled(self, loss: torch.Tensor, verb: str) -> torch.Tensor:
        for opt in self.iteration.members:  # a scaled loss may reach the params of any optimizer sharing the scale
            opt.refuse_after_unscale(verb)
        if self._watching is not None:
            self._watching.loss(loss)
        return self.scaler.scale_loss(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor | None:
        """Unscale this step's grads now (e.g. before clipping); returns found_inf.

        ``optimizer`` (one of ``amp.optimizers`` or the one it wraps): only its grads, as
        ``GradScaler.unscale_(optimizer)``; by default every optimizer's (flags summed). With master weights the model's
        low-precision parameters then show the masters' fp32 gradients (:class:`unimp_torch.params.MasterGrad`).
        Refused when no loss was scaled since the last step."""
        self._check_live("amp.unscale_()")
        found = None
        for opt in self._chosen(optimizer, "amp.unscale_(optimizer)"):
            f = opt.unscale_()
            found = f if found is None or f is None else found + f
        return found

    def _chosen(self, optimizer: Any, verb: str) -> list[AmpOptimizer]:
        if optimizer is None:
            return list(self.optimizers)
        for opt in self.optimizers:
            if optimizer is opt or optimizer is opt.optimizer:
                return [opt]
        raise ValueError(f"{verb}: this {type(optimizer).__name__} is not one of this Amp's optimizers "
                         f"({len(self.optimizers)} wrapped); pass one of amp.optimizers, or wrap it first: "
                         f"amp.add_optimizer(optimizer)")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> torch.Tensor:
        """Clip the unscaled gradients (of the masters, when there are masters) of every optimizer together;
        returns the norm."""
        self._check_live("amp.clip_grad_norm_()")
        if not self.optimizers:
            params = list(self.model.parameters())
        else:
            params = []
            for opt in self.optimizers:
                opt.unscale_()
                params += opt.master_params()
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, **kwargs)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> AmpOptimizer:
        """Wrap one more optimizer of this model; returns the wrapper to step (``amp.optimizers[-1]``).

        It shares the Amp's loss scale. Built before or after ``apply``: where the policy keeps fp32 masters, its
        low-precision parameters are replaced in its param groups (and state) by their masters.

        >>> import torch, unimp
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> amp = unimp.apply("fp16_master", m, torch.optim.SGD(m[0].parameters(), lr=0.1))
        >>> head = amp.add_optimizer(torch.optim.SGD(m[1].parameters(), lr=0.1))
        >>> head.param_groups[0]["params"][0].dtype, len(amp.optimizers)
        (torch.float32, 2)
        >>> _ = amp.remove()
        """
        self._check_live("amp.add_optimizer()")
        if isinstance(optimizer, AmpOptimizer):
            raise ValueError("amp.add_optimizer(optimizer): this optimizer is already wrapped by unimp "
                             "(an amp.optimizers entry); pass the torch.optim optimizer itself")
        if any(optimizer is m.optimizer for m in self.iteration.members):
            raise ValueError("amp.add_optimizer(optimizer): this optimizer is already wrapped (it is in "
                             "amp.optimizers); step that wrapper")
        # where masters exist, the model holds low-precision copies: the optimizer steps their masters
        by_low = {i: orig for i, (_, orig) in self.params.home.items()}
        low_of = {id(orig): low for low, orig in self.params.home.values()}
        taken = {}
        for i, opt in enumerate(self.optimizers):
            for p in opt.master_params():
                taken[id(p)] = f"amp.optimizers[{i}]"
                if id(p) in low_of:
                    taken[id(low_of[id(p)])] = f"amp.optimizers[{i}]"
        own = {id(p) for p in self.module.parameters()} | set(low_of)  # built after apply or before (originals)
        check_optimizers(self.module, [optimizer], "amp.add_optimizer(optimizer)", taken, own)
        remap = {id(p): by_low[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in by_low}
        if remap:
            for group in optimizer.param_groups:
                group["params"] = [by_low.get(id(p), p) for p in group["params"]]
            optimizer.state = defaultdict(dict, {remap.get(id(p), p): v for p, v in optimizer.state.items()})
        self.params.add_masters({id(p) for g in optimizer.param_groups for p in g["params"]},
                                dict(self.module.named_parameters()))
        return self._wrap_optimizer(optimizer)

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> AmpOptimizer:
        from . import strays

        names = {id(p): n for n, p in self.module.named_parameters()} | {id(m): n for n, _, m in self.params.masters}
        wrapped = AmpOptimizer(optimizer, self.scaler, self.params, self.on_skip, self._check_live, names,
                               self.iteration)
        try:
            self._undo.append(AfterInnerStep.attach(wrapped))
            self._undo.append(lambda: self.iteration.leave(wrapped))
            wrapped.agree = self.agree
            self.optimizers.append(wrapped)
            if self.optimizer is None:
                self.optimizer = wrapped
            strays.wrapped(self, wrapped)
        except BaseException:
            self.iteration.leave(wrapped)
            raise
        return wrapped

    def update(self) -> None:
        """End the iteration: the loss scale updated from the optimizers that stepped since the last update
        (``GradScaler.update()``); needed only when not every optimizer sharing the scale steps every iteration."""
        self._check_live("amp.update()")
        self.iteration.update()
        self.iteration.notify()

    def ddp(self, **kwargs: Any) -> nn.Module:
        """``DistributedDataParallel(amp.model, **kwargs)`` under the policy; sets and returns ``amp.model``
        (:mod:`unimp_torch.distributed`)."""
        from .distributed import make_ddp

        self._check_live("amp.ddp()")
        return make_ddp(self, **kwargs)

    @property
    def fp8_layers(self) -> dict[str, str]:
        """``{module path: FP8 recipe}`` of the layers that run FP8 (the Plan's choice; empty if none)."""
        self._check_live("amp.fp8_layers")
        return dict(self.fp8.layers) if self.fp8 is not None else {}

    @property
    def master_weights(self) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """``(name, low-precision param, fp32 master)`` for every parameter with a master."""
        self._check_live("amp.master_weights")
        return list(self.params.masters)

    def masters_in_model(self) -> AbstractContextManager[None]:
        """The fp32 masters (and fp32 originals of frozen params) in the model for a ``with`` block, e.g. to export or
        ``save_pretrained`` the full-precision weights; then the low-precision copies again, recast from the masters.

        >>> import torch, unimp
        >>> m = torch.nn.Linear(2, 2)
        >>> amp = unimp.apply("pure_bf16", m, torch.optim.SGD(m.parameters(), lr=0.1))
        >>> with amp.masters_in_model():
        ...     m.weight.dtype
        torch.float32
        >>> m.weight.dtype
        torch.bfloat16
        >>> _ = amp.remove()
        """
        self._check_live("amp.masters_in_model()")
        return self.params.originals_in_model()

    def _start_watch(self, watch: Any) -> None:
        """``amp.watch(...)`` (the core's): measure for ``watch`` (:mod:`unimp_torch.watch`)."""
        from .watch import start

        start(self, watch)

    def _tensorboard_writer(self, logdir: Any) -> Any:
        from .watch import tensorboard

        return tensorboard(logdir)

    def loss_scale_state(self) -> LossScaleState:
        self._check_live("amp.loss_scale_state() (amp.scale, amp.skipped_steps)")
        return self.scaler.state()

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        self._check_live("amp.set_loss_scale_state()")
        self.scaler.set_state(state)
        self.iteration.reset()

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state (:meth:`unimp.Amp.state_dict`), between iterations: refused while some optimizers
        sharing the scale stepped and others have not (the update those flags wait for is not in the state)."""
        self._check_live("amp.state_dict()")
        self.iteration.refuse_pending("amp.state_dict()")
        return super().state_dict()

    def report(self, *args: Any, **kwargs: Any) -> Report:
        """Per module path: kind, observed compute/param/output dtype. With inputs, runs a fresh
        no-grad forward on them; without, uses the first forward after apply."""
        self._check_live("amp.report()")
        if args or kwargs:
            observed = observe(self.module, args, kwargs)
        elif self._observer.rows is not None:
            observed = self._observer.rows
        elif (spec := getattr(self.module.__dict__.get("forward"), "compiled_inputs", None)) is not None:
            # the forwards ran compiled (nothing is observed inside a graph): one eager no-grad forward on inputs
            # shaped like the first call's (buffers and RNG left as they were)
            self._observer.rows = observe(self.module, *example_inputs(spec))
            observed = self._observer.rows
        else:
            raise self.no_forward()
        fp8 = self.fp8.layers if self.fp8 is not None else {}
        rows = [ReportRow(path or "<model>", r["kind"], r["compute_dtype"], r["param_dtype"], r["output_dtype"],
                          fp8.get(path))
                for path, r in observed.items() if is_layer(path, self.module.get_submodule(path))]
        notes = [f"wrapped per layer: {', '.join(self.wrapped)}"] if self.wrapped else []
        if not (args or kwargs) and self._observer.entry is not None:
            notes.append(f"rows observed during the first call after apply: model.{self._observer.entry}() (every "
                         f"forward it made)")
        notes += Fp8Decision.report_notes(self.fp8.decisions) if self.fp8 is not None else []
        return self.report_header(rows, notes)

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchAmp:
        """The copy (:meth:`unimp.Amp.__deepcopy__`) guards its own model and optimizers (:mod:`unimp_torch.strays`)."""
        from . import strays

        new = super().__deepcopy__(memo)
        strays.watch(new)
        for opt in new.optimizers:
            strays.wrapped(new, opt)
        return new

    def _restore(self) -> None:
        from . import strays

        strays.unwatch(self)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.params.restore()
        restore_layout(self._layout)


def bind(plan: Plan, model: nn.Module, optimizer: Any, device: str,
         on_skip: Callable[[], Any] | None, fsdp: bool = False, shared: TorchAmp | None = None) -> TorchAmp:
    """Apply ``plan`` to ``model``; on any error, everything done so far is undone.

    ``optimizer``: None, one optimizer or a list/tuple of them (all sharing one loss scale). ``fsdp``: the model is
    sharded with FSDP2 (:mod:`unimp_torch.distributed`). ``shared``: an Amp whose loss scale this one shares.
    """
    from . import strays

    optimizers = as_list(optimizer)
    if isinstance(model.__dict__.get("forward"), PolicyForward):
        raise RuntimeError(f"unimp.apply: this {type(model).__name__} is a copy of a model with a unimp "
                           f"policy applied (its forward already runs under that policy); apply the policy "
                           f"to a fresh model, or use the copy as it is")
    if not plan.layers:  # compiled without the model: index it once
        plan = plan.with_index(model_index(model))
    amp = TorchAmp(plan, model, optimizers[0] if optimizers else None, device, shared)
    amp.optimizer, amp.on_skip = None, on_skip
    try:
        amp.findings = list(plan.layout.act("torch"))
        if fsdp:
            from .distributed import check_fsdp

            check_fsdp(model, plan)
            if plan.channels_last and has_conv2d(model):
                amp.findings.append("layout: channels_last not applied to an FSDP2-sharded model (its "
                                    "parameters are DTensor shards); call model.to(memory_format="
                                    "torch.channels_last) before fully_shard")
        elif plan.channels_last and has_conv2d(model):
            amp._layout = to_channels_last(model)
        optimized = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
        if not fsdp:
            amp.params = cast_params(model, plan, optimized)
        if plan.fp8 is not None and plan.fp8.active:  # after the params' dtypes: Float8Linear shares them
            from .fp8 import convert

            amp.fp8, undo = convert(plan, model, device, fsdp)
            amp._undo.append(undo)
        _wrap_layers(amp, model, plan, device)
        details = plan.details
        autocast = DTYPES[details.autocast] if details.autocast else None
        compute = DTYPES[plan.compute_dtype]
        params_up = compute if compute == torch.float32 and any(
            p.is_floating_point() and p.dtype != torch.float64 and p.itemsize < compute.itemsize
            for p in model.parameters()) else None  # e.g. float16 storage, float32 compute
        amp._undo.append(patch_forward(model, device, autocast, details.op_moves,
                                       output_cast(plan), bool(amp._layout), params_up))
        model.__dict__["forward"].observer = amp._observer
        amp._undo.append(save_full_precision(amp, model))  # HF save_pretrained: the fp32 masters
        amp._undo.append(track_ema(amp))  # AveragedModel(model): the EMA of the fp32 masters
        for opt in optimizers:
            amp._wrap_optimizer(opt)
        strays.watch(amp)
        if fsdp:
            from .distributed import attach_fsdp

            attach_fsdp(amp, model)
    except BaseException:
        amp._restore()
        raise
    return amp


def _wrap_layers(amp: TorchAmp, model: nn.Module, plan: Plan, device: str) -> None:
    """A layer-level forward on each module an override sets the compute dtype of."""
    for path, module in model.named_modules():
        names, k = type_names(module), kind(module)
        decision = plan.decide(path, k, names)
        if decision.sets_compute and decision.compute_dtype is not None:  # the override's (or, for auto, the Plan's)
            composite = any(True for _ in module.children()) and decision.compute_dtype != "float32"
            amp._undo.append(wrap(module, Rule(decision.compute_dtype, composite), device))
            amp.wrapped.append(path or "<model>")
