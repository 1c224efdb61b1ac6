"""Every speculative method, from the descriptors its modules declare; the parser of ``speculative_config`` dicts.

The registry imports each module of ``speculative/methods/`` once, when it is first imported, and collects the
``METHOD`` descriptor (method.py) each declares: adding a method is a new module there and nothing else. The
arrows run from the registry down to the methods and never back. ``auto`` (router.py) is the one name that is no
module: it chooses per request and step among the methods whose descriptors allow it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from leapdecode.config import SHARED_KEYS, SpeculativeConfig
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.speculative import methods as methods_package
from leapdecode.speculative.method import AUTO_BRANCHES, Method
from leapdecode.speculative.options import group_keys
from leapdecode.speculative.proposer import EngineView, Proposer
from leapdecode.speculative.router import AUTO, AUTO_IGNORES, AutoOptions


def _discover() -> dict[str, Method]:
    """The descriptors of the modules under ``speculative/methods/``, by method name (modules in name order)."""
    found: dict[str, Method] = {}
    for info in sorted(pkgutil.iter_modules(methods_package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{methods_package.__name__}.{info.name}")
        desc = getattr(module, "METHOD", None)
        if not isinstance(desc, Method):
            raise TypeError(f"{module.__name__} declares no METHOD descriptor (speculative/method.py)")
        if desc.name in found or desc.name == AUTO:
            raise ValueError(f"speculative method {desc.name!r} is declared twice ({module.__name__})")
        found[desc.name] = desc
    return found


METHODS: dict[str, Method] = _discover()


def refresh() -> None:
    """Collect the descriptors again, e.g. after a folder of method modules joined the package's search path
    (``methods.__path__``: plug-ins, or a test's example method)."""
    METHODS.clear()
    METHODS.update(_discover())


def method_names() -> tuple[str, ...]:
    """Every value ``"method"`` takes: the methods, then ``auto``."""
    return (*METHODS, AUTO)


def auto_candidates() -> list[Method]:
    """The methods ``auto`` may choose among, by branch of its decision tree and preference there."""
    ranked = [d for d in METHODS.values() if d.auto is not None]
    return sorted(ranked, key=lambda d: (AUTO_BRANCHES.index(d.auto.branch), d.auto.rank))  # type: ignore[union-attr]


# ----------------------------------------------------------------------------------------------- parsing
def _reads(method: str) -> tuple[tuple[type, ...], frozenset[str]]:
    """The option groups and the shared keys ``method`` reads (``auto``: its own options and what it builds)."""
    if method != AUTO:
        desc = METHODS[method]
        return desc.options, desc.shared
    groups: list[type] = [AutoOptions]
    shared: set[str] = set()
    for desc in auto_candidates():
        assert desc.auto is not None
        groups += [g for g in desc.auto.options if g not in groups]
        shared |= desc.shared
    return tuple(groups), frozenset(shared - AUTO_IGNORES)


def _refusal(method: str, key: str, groups: tuple[type, ...], shared: frozenset[str]) -> ValueError:
    """The error for a key ``method`` does not read: the methods that read it, and the keys ``method`` takes."""
    readers = [m for m in method_names() if m != method and
               (key in _reads(m)[1] or any(key in group_keys(g) for g in _reads(m)[0]))]
    valid = sorted(shared | {k for g in groups for k in group_keys(g)})
    where = f" ({key} is read by {', '.join(readers)})" if readers else ""
    return ValueError(f"unknown speculative option {key!r} for method {method!r}{where}; valid options: "
                      f"{', '.join(valid) or 'none'}")


def parse_config(d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A ``speculative_config`` dict as a checked ``SpeculativeConfig``: each key filed as a shared setting or into
    the option group(s) that own it; every key the method does not read is a ValueError naming those it does."""
    if d is None or isinstance(d, SpeculativeConfig):
        return d
    if not isinstance(d, dict) or "method" not in d:
        raise ValueError('speculative_config must be a dict with a "method" key, e.g. {"method": "ngram"}')
    method = d["method"]
    if method not in method_names():
        raise ValueError(f"unknown speculative method {method!r}; choose from {method_names()}")
    groups, shared = _reads(method)
    main: dict[str, Any] = {}
    filed: dict[type, dict[str, Any]] = {}
    for key, value in d.items():
        if key == "method":
            continue
        owners = [g for g in groups if key in group_keys(g)]
        if key in SHARED_KEYS and key in shared:
            main[key] = value
        elif key not in SHARED_KEYS and owners:
            for g in owners:
                filed.setdefault(g, {})[key] = value
        else:
            raise _refusal(method, key, groups, shared)
    auto = filed.get(AutoOptions, {}).get("methods")
    if auto is not None:
        allowed = [m.name for m in auto_candidates() if m.auto is not None and m.auto.branch != "lossy"]
        if not isinstance(auto, (list, tuple)) or not auto or not set(auto) <= set(allowed):
            raise ValueError(f'auto\'s "methods" must be a non-empty list drawn from {allowed}, got {auto!r}')
    return SpeculativeConfig(method=method, **main, groups=tuple(g(**kw) for g, kw in filed.items()))


# ---------------------------------------------------------------------------------------------- building
def auto_methods(cfg: SpeculativeConfig, target: LlamaForCausalLM | None = None) -> list[str]:
    """What ``auto`` chooses among: every method whose descriptor lets auto pick it and that is usable here without
    further arguments (a trained drafter only when its shipped artifact was trained for ``target``), or only those
    the config's ``"methods"`` list names; with ``"lossless": false`` also the lossy branch's, where they fit."""
    opts = cfg.options(AutoOptions)
    wanted = opts.methods
    usable = [d for d in auto_candidates() if d.auto is not None and d.auto.usable(cfg, target)]
    names = [d.name for d in usable if d.auto is not None and d.auto.branch != "lossy"]
    if wanted is not None:
        missing = [m for m in wanted if m not in names]
        if missing:
            raise ValueError(f"auto cannot use {missing} here (no shipped drafter for this model, or no \"model\")")
        names = [m for m in names if m in wanted]
    if not opts.lossless:
        names += [d.name for d in usable if d.auto is not None and d.auto.branch == "lossy"]
    return names


def make_proposer(cfg: SpeculativeConfig, view: EngineView, method: str | None = None) -> Proposer:
    """The proposer of ``method`` (default: the config's; ``auto`` builds each of its candidates this way)."""
    method = method or cfg.method
    desc = METHODS.get(method)
    if desc is None:
        raise ValueError(f"unknown speculative method {method!r}; choose from {sorted(METHODS)}")
    return desc.build(cfg, view, cfg.method == AUTO)


def bench_configs(lossy: bool = False) -> dict[str, dict]:
    """``leapdecode bench``'s labels -> configurations: each method alone, its descriptor's variants, and
    ``auto`` (``lossy``: the lossy variants the report's quality table measures instead)."""
    if lossy:
        return {label: cfg for d in METHODS.values() for label, cfg in d.lossy_bench.items()}
    out: dict[str, dict] = {}
    for d in METHODS.values():
        out[d.name] = {"method": d.name}
        out.update(d.bench)
    out[AUTO] = {"method": AUTO}
    return out


__all__ = ["METHODS", "auto_candidates", "auto_methods", "bench_configs", "make_proposer", "method_names",
           "parse_config", "refresh"]
