"""Which ``policyRuleURI`` forms exist and which built-ins fill which policy slot: one table that
the spec validation (``component add``, the parser), the runtime and the docs share. Pure data:
the schemas import it without loading any policy code.

URI forms: ``builtin:NAME`` (below), ``registry:NAME[@VERSION]`` (``blocks policy add``),
``NAME.py`` / ``NAME.star`` (the registry entry named by the file's stem), ``package.module:Class``
(an importable class).
"""

from __future__ import annotations

import re

#: built-in policy -> the policy slots (``PolicyRule.name``) it can fill
BUILTIN_KINDS: dict[str, tuple[str, ...]] = {
    "builtin:cluster-rank": ("clusterAllocator",),
    "builtin:binpack": ("resourceAllocator",),
    "builtin:spread": ("resourceAllocator",),
    "builtin:round-robin": ("loadBalancer",),
    "builtin:least-inflight": ("loadBalancer",),
    "builtin:least-queue": ("loadBalancer",),
    "builtin:target-inflight": ("autoscaler",),
    "builtin:queue-depth": ("autoscaler",),
    "builtin:probe-threshold": ("stabilityChecker",),
    # the GPU-sharing baselines of the FGD paper (policies/builtin/frag.py, docs/trace.md)
    "builtin:random": ("resourceAllocator",),
    "builtin:dot-product": ("resourceAllocator",),
    "builtin:gpu-packing": ("resourceAllocator",),
    "builtin:gpu-clustering": ("resourceAllocator",),
    "builtin:best-fit": ("resourceAllocator",),
    "builtin:fgd": ("resourceAllocator",),
    # ours: FGD with a look-ahead measure (policies/builtin/fgd_plus.py, docs/trace.md)
    "builtin:fgd-plus": ("resourceAllocator",),
    # the default preemption policy (policies/builtin/preempt.py, docs/priority.md)
    "builtin:preempt-min": ("preemption",),
    # the default rebalancer policy (policies/builtin/rebalance.py, docs/rebalance.md)
    "builtin:rebalance-min": ("rebalancer",),
}

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE_CLASS = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}$")
_REGISTRY = re.compile(r"^registry:[A-Za-z0-9][A-Za-z0-9_-]{0,127}(@[0-9]+)?$")


def known_builtins() -> str:
    return ", ".join(sorted(BUILTIN_KINDS))


def uri_problem(uri: str, slot: str | None = None) -> str | None:
    """Why ``uri`` can never load (for the policy slot ``slot``), or None when it may."""
    if uri.startswith("builtin:"):
        kinds = BUILTIN_KINDS.get(uri)
        if kinds is None:
            return f"unknown built-in policy {uri!r}; the built-ins are {known_builtins()}"
        if slot is not None and slot in _SLOTS and slot not in kinds:
            fits = sorted(u for u, k in BUILTIN_KINDS.items() if slot in k)
            return f"{uri} is a {' / '.join(kinds)} policy, not a {slot} one" + (f"; for {slot}: {', '.join(fits)}" if fits else "")
        return None
    if uri.startswith("registry:"):
        return None if _REGISTRY.match(uri) else f"{uri!r} is not registry:NAME or registry:NAME@VERSION"
    if uri.endswith((".py", ".star")) or _MODULE_CLASS.match(uri):
        return None
    return (f"{uri!r} is not a policyRuleURI: use builtin:NAME ({known_builtins()}), registry:NAME[@VERSION], "
            "NAME.py / NAME.star, or package.module:Class")


#: the slots a built-in may be checked against
_SLOTS = ("clusterAllocator", "resourceAllocator", "loadBalancer", "stabilityChecker", "autoscaler", "preemption", "rebalancer")
