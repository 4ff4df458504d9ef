"""Migration: read another system's mixed-precision configuration as a unimp policy, and write a
policy back as that system's configuration.

One module per system, each with ``import_policy`` / ``from_cli`` / ``export_policy``; the public
entry points are :mod:`unimp.migrate.importers` and :mod:`unimp.migrate.exporters` and ``unimp import`` /
``unimp export``.

>>> from unimp import migrate
>>> migrate.import_from("torch", "init_scale=256.0").policy.loss_scale.initial
256.0
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from unimp.errors import PolicyError
from unimp.migrate.draft import Exported, Imported
from unimp.policy.ops import suggest
from unimp.policy.spec import show

SYSTEMS: dict[str, str] = {
    "deepspeed": "deepspeed", "apex": "apex", "accelerate": "accelerate", "lightning": "lightning",
    "keras": "keras", "tf_keras": "keras", "torch": "torch", "paddle": "paddle", "jmp": "jmp",
    "flax": "flax", "megatron": "megatron", "neox": "neox", "hf_trainer": "hf_trainer",
    "paddlenlp": "paddlenlp",
}


def module(system: str) -> ModuleType:
    """The module of ``system`` (``unimp.migrate.<name>``); a located error for an unknown one."""
    if system not in SYSTEMS:
        h = suggest(system, SYSTEMS)
        tail = f"did you mean '{h}'?" if h else f"systems: {', '.join(SYSTEMS)}"
        raise PolicyError(f"<argument>: --from/--to: unknown system {system!r} ({tail})")
    return importlib.import_module(f"{__name__}.{SYSTEMS[system]}")


HJSON = ("deepspeed",)  # systems that read their JSON as hjson (comments allowed): given its text, not parsed JSON
ASSUMES = ("deepspeed",)  # systems whose "auto" values resolve from assumed run arguments (HF Trainer)


def import_from(system: str, raw: Any, source: str | None = None, assume: dict[str, Any] | None = None) -> Imported:
    """A policy from ``raw`` (a string as pasted on the command line, or a parsed config file);
    ``assume``: the run's arguments a system's ``"auto"`` values resolve from (DeepSpeed: HF Trainer's).

    Every system's input goes through one path: its size and shape are bounded and checked
    (:func:`~unimp.migrate.parsing.plain`) before the system's reader sees it, and the policy file
    is checked to load back to the policy reported (:func:`~unimp.migrate.draft.checked`).
    """
    from unimp.migrate.draft import checked
    from unimp.migrate.parsing import MAX_TEXT, plain
    from unimp.migrate.values import bad

    mod = module(system)
    src = source or system
    if assume is not None and system not in ASSUMES:
        raise bad("<argument>", "--assume", f"{system} has no 'auto' values to resolve; remove --assume "
                                            f"(it applies to {', '.join(ASSUMES)})")
    extra = {"assume": plain(assume, "<argument>: --assume")} if assume is not None else {}
    if isinstance(raw, str) and len(raw) > MAX_TEXT:  # every system, not only those parsing calls
        raise bad(src, "", f"{len(raw)} characters; a pasted configuration is at most {MAX_TEXT}")
    raw = plain(raw, src)
    if isinstance(raw, list) and not (system == "megatron" and all(isinstance(a, str) for a in raw)):
        raise bad(src, "", f"expected a table (a configuration file) or a string, got {show(raw)}; pass the "
                           f"{system} configuration itself")
    if not isinstance(raw, str | dict | list):
        raise bad(src, "", f"expected a table (a configuration file) or a string, got {show(raw)}")
    if system == "tf_keras":
        return checked(mod.from_cli(raw, src, tf_keras=True))
    return checked(mod.from_cli(raw, src, **extra))


def export_to(system: str, policy: Any, strict: bool = False, into: Any = None,
              into_source: str = "<argument>: --into") -> Exported:
    """``policy`` (anything :func:`unimp.load` takes) as ``system``'s configuration; ``into``: the
    user's own configuration (a parsed file, or its text), of which only the precision keys change.

    >>> out = export_to("deepspeed", "deepspeed_bf16", into={"bf16": {"enabled": False},
    ...                 "zero_optimization": {"stage": 3}, "train_batch_size": 8})
    >>> out.config
    {'bf16': {'enabled': True}, 'zero_optimization': {'stage': 3}, 'train_batch_size': 8}
    """
    from unimp.migrate.parsing import plain
    from unimp.migrate.values import bad
    from unimp.policy.loading import load

    mod = module(system)
    p = load(policy)
    out: Exported
    if into is None:
        out = mod.export_policy(p, tf_keras=True) if system == "tf_keras" else mod.export_policy(p)
        return out.strict() if strict else out
    if not hasattr(mod, "OWNED"):
        raise bad(into_source, "", f"{system}'s configuration is not a file export can merge into (exports that "
                                   f"can: {', '.join(s for s in SYSTEMS if hasattr(module(s), 'OWNED'))}); "
                                   f"paste the printed configuration instead")
    if isinstance(into, str):
        into = mod.read_config(into, into_source) if hasattr(mod, "read_config") else into
    into = plain(into, into_source)
    if not isinstance(into, dict):
        raise bad(into_source, "", f"expected the {system} configuration file (a table), got {show(into)}")
    out = mod.export_policy(p, into=into)
    return out.strict() if strict else out


__all__ = ["SYSTEMS", "Exported", "Imported", "export_to", "import_from", "module"]
