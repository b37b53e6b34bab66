"""Quotas that borrow (issue 36, docs/priority.md): pure accounting, no I/O.

A tenant (a block's ``tenant`` label, else its virtual cluster) has a nominal quota per GPU model
(``*``: every model together): resource -> amount (``schemas.priority.QuotaResource``). Tenants of
one cohort lend each other what they leave idle: a tenant may go above its nominal as long as the
cohort's usage stays within the cohort's nominal (the sum of its members'), and within its own
``borrowingLimit``. An owner that wants back what it lent reclaims it by preempting the borrowers
(Kueue's ``InCohortReclamation``), only from tenants that still borrow.

``decide`` says, for one request: ``admit`` (within nominal), ``admit-borrowing`` (above nominal,
the cohort has it idle), ``reclaim`` (within nominal, but borrowers hold the cohort's room: these
blocks of theirs may be preempted) or ``wait``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..schemas.priority import ANY_MODEL, PreemptReason, Quota, QuotaResource

#: model -> resource -> amount
Usage = dict[str, dict[str, float]]
#: float sums of thousandths: compare with a little slack
EPS = 1e-9


class Verdict(enum.StrEnum):
    ADMIT = "admit"
    ADMIT_BORROWING = "admit-borrowing"
    RECLAIM = "reclaim"
    WAIT = "wait"


@dataclass(frozen=True)
class Holding:
    """One running block as the accounting sees it: whose it is, what it uses per model, and what
    the reclaim order reads (priority, then the youngest first)."""

    block_id: str
    tenant: str
    usage: Usage
    priority: int = 0
    created: float = 0.0
    preemptible: bool = True


@dataclass
class Decision:
    verdict: Verdict
    reason: str
    #: model -> resource -> what this tenant would borrow above its nominal once admitted
    borrowed: Usage = field(default_factory=dict)
    #: reclaim: the borrowers' blocks the owner may preempt (reason ``InCohortReclamation``)
    victims: list[str] = field(default_factory=list)
    victim_reason: str = ""


def tenant_of(ir: Mapping[str, Any]) -> str | None:
    """A block's tenant: its ``tenant`` label, else its virtual cluster, else none."""
    labels = ir.get("labels") or {}
    tenant = labels.get("tenant") if isinstance(labels, dict) else None
    return str(tenant) if tenant else (str(ir["virtualClusterId"]) if ir.get("virtualClusterId") else None)


def instance_usage(resources: Mapping[str, Any], gpu_ids: list[str], gpu_model: Mapping[str, str]) -> Usage:
    """What one placed instance uses, under the model of its GPUs (``*`` also counts it)."""
    share = float(resources.get("gpuShare") or 0.0)
    amounts: dict[str, float] = {
        QuotaResource.CPU: float(resources.get("cpu") or 0.0),
        QuotaResource.MEMORY: float(resources.get("memory") or 0),
    }
    if share > 0:
        amounts[QuotaResource.GPU_SHARE] = share * max(1, len(gpu_ids))
    else:
        amounts[QuotaResource.GPUS] = float(len(gpu_ids))
    models = {gpu_model.get(g, "") for g in gpu_ids} - {""}
    out: Usage = {ANY_MODEL: dict(amounts)}
    if models:
        out[sorted(models)[0]] = dict(amounts)
    return out


def request_usage(resources: Mapping[str, Any], instances: int, model: str = ANY_MODEL) -> Usage:
    """What ``instances`` more instances of a block would use, on ``model`` (``*``: not known yet)."""
    gpus = int(resources.get("gpus") or 0)
    fake = [f"_{i}" for i in range(gpus)]
    one = instance_usage(resources, fake, {g: model for g in fake} if model != ANY_MODEL else {})
    return {m: {r: v * instances for r, v in a.items()} for m, a in one.items()}


def holdings_of(rows: Iterable[Mapping[str, Any]], gpu_model: Mapping[str, str]) -> list[Holding]:
    """The blocks with a tenant and instances (``state.priority.PriorityStore.placed``'s rows),
    as the accounting sees them: every instance in the state holds its reservation."""
    out = []
    for row in rows:
        ir = row.get("ir") or {}
        tenant = tenant_of(ir)
        if tenant is None:
            continue
        usage: Usage = {}
        for inst in (row.get("instances") or {}).values():
            add(usage, instance_usage(ir.get("resources") or {}, list(inst.get("gpus") or []), gpu_model))
        if usage:
            out.append(Holding(str(row["block_id"]), tenant, usage, int(ir.get("priority") or 0),
                               float(row.get("created") or 0.0), ir.get("preemptible") is not False))
    return out


#: a usage counter's field: tenant, model, resource (``state.keys.quota_usage_key``)
SEP = "\t"
#: the counters' version, in the usage hash's field ``VERSION_FIELD`` (not a ``tenant<TAB>model<TAB>
#: resource`` field: ``from_fields`` passes over it). A hash without it (reservations made before
#: the counters existed, or the hash dropped) is rebuilt from the reservations on first use
#: (``state.priority.PriorityStore.usage_counters``); ``blocks recover`` writes it.
COUNTERS_VERSION = "1"
VERSION_FIELD = "v"
#: the block id of a tenant's total (``workers.queue.quota_view`` from the counters: not a block)
TOTAL = "total:"


def fields(tenant: str, usage: Usage) -> dict[str, float]:
    """A tenant's usage as the counters' fields (``tenant<TAB>model<TAB>resource`` -> amount)."""
    return {SEP.join((tenant, m, r)): v for m, a in sorted(usage.items()) for r, v in sorted(a.items()) if v}


def from_fields(counters: Iterable[Mapping[str, Any]]) -> dict[str, Usage]:
    """Tenant -> usage, summed over counter hashes (one per cluster); a field at 0 is left out."""
    out: dict[str, Usage] = {}
    for h in counters:
        for f, v in h.items():
            parts = str(f).split(SEP)
            if len(parts) != 3 or not float(v):
                continue
            tenant, model, res = parts
            row = out.setdefault(tenant, {}).setdefault(model, {})
            row[res] = row.get(res, 0.0) + float(v)
    return out


def with_quota(ir: Mapping[str, Any], placements: Iterable[Mapping[str, Any]],
               nodes: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The reservation records with what each adds to its tenant's usage counters (``quota``: the
    fields ``instance_usage`` gives for its GPUs' models, as ``holdings_of`` counts it); the
    records of a block without a tenant unchanged."""
    tenant = tenant_of(ir)
    out = [dict(p) for p in placements]
    if tenant is None:
        return out
    for p in out:
        node = nodes.get(str(p.get("node"))) or {}
        models = {str(g.get("id")): str(g.get("model") or "") for g in node.get("gpus") or ()}
        p["quota"] = fields(tenant, instance_usage(ir.get("resources") or {}, list(p.get("gpus") or []), models))
    return out


class QuotaRow(TypedDict):
    """One row of ``blocks quota list`` (:func:`report`): a tenant's use of one GPU model against
    its quota, by resource."""

    tenant: str
    cohort: str
    model: str
    usage: dict[str, float]
    nominal: dict[str, float]
    borrowed: dict[str, float]


def add(into: Usage, more: Usage, sign: float = 1.0) -> Usage:
    for model, amounts in more.items():
        row = into.setdefault(model, {})
        for res, v in amounts.items():
            row[res] = row.get(res, 0.0) + sign * v
    return into


def usage_by_tenant(holdings: Iterable[Holding]) -> dict[str, Usage]:
    out: dict[str, Usage] = {}
    for h in holdings:
        add(out.setdefault(h.tenant, {}), h.usage)
    return out


def _limits(q: Quota, which: str = "nominal") -> Usage:
    src = q.nominal if which == "nominal" else (q.borrowingLimit or {})
    return {m: {str(r): float(v) for r, v in a.items()} for m, a in src.items()}


def _over(usage: Usage, limits: Usage) -> list[tuple[str, str, float]]:
    """(model, resource, excess) wherever ``usage`` exceeds ``limits`` (resources limits leave out: free)."""
    out = []
    for model, amounts in limits.items():
        used = usage.get(model, {})
        for res, cap in amounts.items():
            if used.get(res, 0.0) > cap + EPS:
                out.append((model, res, used.get(res, 0.0) - cap))
    return out


def _sum(rows: Iterable[Usage]) -> Usage:
    total: Usage = {}
    for r in rows:
        add(total, r)
    return total


def borrowed(usage: Usage, q: Quota) -> Usage:
    """What ``usage`` holds above the nominal, per model and resource (0 left out)."""
    out: Usage = {}
    for model, res, excess in _over(usage, _limits(q)):
        out.setdefault(model, {})[res] = excess
    return out


def decide(tenant: str | None, request: Usage, quotas: Mapping[str, Quota], holdings: list[Holding]) -> Decision:
    """Admit, admit by borrowing, reclaim from borrowers, or wait: see the module's docstring."""
    if not tenant or tenant not in quotas:
        return Decision(Verdict.ADMIT, f"tenant {tenant!r} has no quota" if tenant else "the block names no tenant")
    q = quotas[tenant]
    usage = usage_by_tenant(holdings)
    members = [t for t, tq in quotas.items() if q.cohort and tq.cohort == q.cohort] or [tenant]
    request = _on_every_model(request, {m for t in members for m in quotas[t].nominal})
    mine = add(add({}, usage.get(tenant, {})), request)
    nominal = _limits(q)
    cohort_nominal = _sum(_limits(quotas[t]) for t in members)
    cohort_use = add(_sum(usage.get(t, {}) for t in members), request)
    cohort_fits = not _over(cohort_use, cohort_nominal)
    if not _over(mine, nominal):
        if cohort_fits:
            return Decision(Verdict.ADMIT, "within its nominal quota")
        return _within_nominal(tenant, q, members, quotas, usage, holdings, cohort_use, cohort_nominal)
    return _over_nominal(q, mine, nominal, cohort_fits)


def _within_nominal(tenant: str, q: Quota, members: list[str], quotas: Mapping[str, Quota], usage: dict[str, Usage],
                    holdings: list[Holding], cohort_use: Usage, cohort_nominal: Usage) -> Decision:
    """Within its nominal, but the cohort is full: reclaim from borrowers, or wait."""
    victims = _reclaim(tenant, members, quotas, usage, holdings, cohort_use, cohort_nominal)
    if victims is not None:
        return Decision(Verdict.RECLAIM, f"within its nominal quota; borrowers of cohort {q.cohort} hold the room",
                        victims=victims, victim_reason=PreemptReason.IN_COHORT_RECLAMATION)
    return Decision(Verdict.WAIT, "within its nominal quota, but the cohort's room is not held by borrowers it may reclaim")


def _over_nominal(q: Quota, mine: Usage, nominal: Usage, cohort_fits: bool) -> Decision:
    """Over its nominal: borrow from the cohort's idle room, or wait."""
    excess = _over(mine, nominal)
    what = ", ".join(f"{m}.{r} +{x:g}" for m, r, x in excess)
    if not q.cohort:
        return Decision(Verdict.WAIT, f"over its nominal quota ({what}) and in no cohort to borrow from")
    if q.borrowingLimit is not None and _over(borrowed(mine, q), _limits(q, "borrowingLimit")):
        return Decision(Verdict.WAIT, f"would borrow past its borrowingLimit ({what})")
    if not cohort_fits:
        return Decision(Verdict.WAIT, f"over its nominal quota ({what}) and cohort {q.cohort} has not that much idle")
    return Decision(Verdict.ADMIT_BORROWING, f"borrows from cohort {q.cohort}: {what}", borrowed=borrowed(mine, q))


def _on_every_model(request: Usage, models: set[str]) -> Usage:
    """A request whose GPU model is not known yet (only ``*``) counts against every model's quota:
    it may land on any of them."""
    if set(request) - {ANY_MODEL} or ANY_MODEL not in request:
        return request
    return {**{m: dict(request[ANY_MODEL]) for m in models}, ANY_MODEL: request[ANY_MODEL]}


def _reclaim(tenant: str, members: list[str], quotas: Mapping[str, Quota], usage: dict[str, Usage],
             holdings: list[Holding], cohort_use: Usage, cohort_nominal: Usage) -> list[str] | None:
    """The borrowers' blocks whose preemption brings the cohort back within its nominal: the
    lowest priority, then the youngest first, each taken only while its tenant still borrows (a
    tenant within its nominal is never reclaimed from; Kueue's rule). ``None`` when they cannot."""
    left = {t: add({}, usage.get(t, {})) for t in members}
    need = add({}, cohort_use)
    victims: list[str] = []
    order = sorted((h for h in holdings if h.tenant in members and h.tenant != tenant and h.preemptible),
                   key=lambda h: (h.priority, -h.created, h.block_id))
    for h in order:
        if not _over(need, cohort_nominal):
            break
        if not borrowed(left[h.tenant], quotas[h.tenant]):
            continue
        victims.append(h.block_id)
        add(left[h.tenant], h.usage, -1.0)
        add(need, h.usage, -1.0)
    return victims if victims and not _over(need, cohort_nominal) else None


def report(quotas: Mapping[str, Quota], holdings: list[Holding]) -> list[QuotaRow]:
    """Per tenant and model: usage, nominal, borrowed (what ``blocks quota list`` shows)."""
    usage = usage_by_tenant(holdings)
    rows: list[QuotaRow] = []
    for tenant in sorted(set(quotas) | set(usage)):
        q = quotas.get(tenant)
        used = usage.get(tenant, {})
        models = sorted(set(used) | set(q.nominal if q else {}))
        lent = borrowed(used, q) if q else {}
        for model in models:
            if q is not None and model not in q.nominal:
                continue
            rows.append({
                "tenant": tenant, "cohort": (q.cohort if q else None) or "", "model": model,
                "usage": {r: round(v, 3) for r, v in used.get(model, {}).items() if v},
                "nominal": {str(r): v for r, v in (q.nominal.get(model, {}) if q else {}).items()},
                "borrowed": {r: round(v, 3) for r, v in lent.get(model, {}).items()},
            })
    return rows
