"""Typed affinity (seed 002): the request model and its TLV wire codec. Pure: no I/O.

Three ways to write affinity on a block normalise to one list of :class:`AffinityEntry`:

* ``affinity``: a list of JSON/YAML entries
  ``{"category": "Topology", "strength": "Required", "anti": true, "target": {"type": "RackId", "value": 42}}``;
* the shorthand ``affinityWith: NODE`` / ``antiAffinityWith: NODE`` (seed §4);
* ``affinityTLV``: base64 of TLV_LEASE_AFFINITY TLVs (seed §2).

Everything is validated fail closed (seed §3). See docs/affinity.md.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import re
import struct
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from .errors import SpecError, SpecInvalid

CATEGORY: dict[str, int] = {"Resource": 0x01, "State": 0x02, "Topology": 0x03, "Trust": 0x04}
#: Adaptive (0x03): scores like Preferred, with a weight the adapt stage moves from live metrics
#: (``policies.affinity.adapt``; docs/affinity.md)
STRENGTH: dict[str, int] = {"Required": 0x01, "Preferred": 0x02, "Adaptive": 0x03}
TARGET_TYPE: dict[str, int] = {
    "NodeId": 0x01,
    "ResourceId": 0x02,
    "LeaseId": 0x03,
    "ServiceId": 0x04,
    "TrustDomain": 0x05,
    "RackId": 0x06,
    #: an extension (docs/topology.md): the GPU link tier a multi-GPU instance's GPUs must (Required)
    #: or should (Preferred) have among themselves; 1 byte, the tier's code (LINK_TIER)
    "LinkTier": 0x07,
}
#: LinkTier targets: the tiers of ``schemas.topology.LinkTier``, best first, and their codes
LINK_TIER: dict[str, int] = {"NVSWITCH": 1, "NVLINK": 2, "PCIE_SWITCH": 3, "HOST_BRIDGE": 4, "NUMA": 5, "SYSTEM": 6}
#: Strengths a category allows in v1 (seed §5): Trust is Required only ("only on attested nodes
#: in domain D": a trust requirement that may be waived is none)
ALLOWED_STRENGTHS: dict[str, tuple[str, ...]] = {
    "Resource": ("Required", "Preferred", "Adaptive"),
    "State": ("Required", "Preferred", "Adaptive"),
    "Topology": ("Required", "Preferred", "Adaptive"),
    "Trust": ("Required",),
}
ALLOWED_TARGETS: dict[str, set[str]] = {
    "Resource": {"NodeId", "ResourceId"},
    "State": {"NodeId", "LeaseId"},
    "Topology": {"NodeId", "RackId", "ServiceId", "LinkTier"},
    "Trust": {"TrustDomain"},
}
#: TLV_LEASE_AFFINITY
TLV_TAG = 0x0910
#: Namespace of the uuid5 that maps a non-UUID id to 128 bits; ``uuid5(NAMESPACE_DNS, "aios-blocks.affinity")``.
AIOS_NAMESPACE: uuid.UUID = uuid.UUID("12c8198f-b4ae-5857-b04d-085eabe56645")

#: Known but not in v1 (seed §2.3): Facility. Adaptive (seed §2.4, reserved there for the adapt
#: stage) is accepted now that the metrics it adapts from exist.
FACILITY = 0x05
ADAPTIVE = 0x03
ANTI_BIT = 0x80
ENTRY_HEADER = 5  # category u8, strength u8, target_type u8, target_len u16
TRUST_DOMAIN_MAX = 255

_CATEGORY_NAME = {v: k for k, v in CATEGORY.items()}
_STRENGTH_NAME = {v: k for k, v in STRENGTH.items()}
_TARGET_NAME = {v: k for k, v in TARGET_TYPE.items()}
_ID_TYPES = frozenset({"NodeId", "ResourceId", "LeaseId", "ServiceId"})
_FACILITY_MSG = "category Facility (0x05) is not supported in v1 (thermal/power/cooling affinity is deferred)"
_ENTRY_KEYS = ("category", "strength", "anti", "direction", "target")
_TARGET_KEYS = ("type", "value")
_DECIMAL_RE = re.compile(r"[0-9]{1,10}")
_LINK_TIER_ANTI = "a LinkTier target is toward only (a tier the GPUs must or should reach), not away"


class AffinityEntry(msgspec.Struct, frozen=True):
    """One normalised affinity constraint (one TLV_LEASE_AFFINITY entry)."""

    category: str  # "Resource" | "State" | "Topology" | "Trust"
    strength: str  # "Required" | "Preferred" | "Adaptive"
    anti: bool  # False = toward, True = away
    target_type: str  # key of TARGET_TYPE
    target: str  # canonical lowercase UUID / UTF-8 trust domain / decimal u32 rack

    def describe(self) -> str:
        """Human text, e.g. ``Required away from RackId 42``."""
        return f"{self.strength} {'away from' if self.anti else 'toward'} {self.target_type} {self.target}"


class TLVError(ValueError):
    """A malformed or not-v1 affinity TLV stream; ``problems`` lists each problem found."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems: list[str] = problems if problems else [message]


class _Bad(Exception):
    """Internal: one validation problem (a message)."""


def id128(value: str) -> uuid.UUID:
    """Our ids are strings; the wire needs 128 bits: a string that parses as a UUID is that UUID,
    any other id is uuid5(AIOS_NAMESPACE, value)."""
    try:
        return uuid.UUID(value)
    except ValueError:
        return uuid.uuid5(AIOS_NAMESPACE, value)


# -- names and codes -------------------------------------------------------------------------


def _hint(value: str, names: list[str]) -> str:
    close = [n for n in names if n.lower() == value.lower()] or difflib.get_close_matches(value, names, n=1)
    return f"; did you mean {close[0]!r}? (names are case-sensitive)" if close else ""


def _category(value: Any) -> str:
    """A category name or code -> its v1 name."""
    names = list(CATEGORY)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _Bad(f"category must be one of {', '.join(names)} (or its code 1..4), not {value!r}")
    if value == "Facility" or value == FACILITY:
        raise _Bad(_FACILITY_MSG)
    if isinstance(value, int):
        if value in _CATEGORY_NAME:
            return _CATEGORY_NAME[value]
        raise _Bad(f"unknown category code {value} (v1 categories: {_codes(CATEGORY)})")
    if value in CATEGORY:
        return value
    raise _Bad(f"unknown category {value!r} (v1 categories: {', '.join(names)}){_hint(value, names)}")


def _strength(value: Any) -> str:
    """A strength name or code -> its name."""
    names = list(STRENGTH)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _Bad(f"strength must be one of {', '.join(names)} (or its code 1..3), not {value!r}")
    if isinstance(value, int):
        if value in _STRENGTH_NAME:
            return _STRENGTH_NAME[value]
        raise _Bad(f"unknown strength code {value} (strengths: {_codes(STRENGTH)})")
    if value in STRENGTH:
        return value
    raise _Bad(f"unknown strength {value!r} (strengths: {', '.join(names)}){_hint(value, names)}")


def _target_type(value: Any) -> str:
    """A target type name or code -> its name."""
    names = list(TARGET_TYPE)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _Bad(f"target type must be one of {', '.join(names)} (or its code 1..7), not {value!r}")
    if isinstance(value, int):
        if value in _TARGET_NAME:
            return _TARGET_NAME[value]
        raise _Bad(f"unknown target type code {value} (target types: {_codes(TARGET_TYPE)})")
    if value in TARGET_TYPE:
        return value
    raise _Bad(f"unknown target type {value!r} (target types: {', '.join(names)}){_hint(value, names)}")


def _codes(table: dict[str, int]) -> str:
    return ", ".join(f"{k}=0x{v:02x}" for k, v in table.items())


def _allowed(category: str, target_type: str) -> None:
    if target_type not in ALLOWED_TARGETS[category]:
        allowed = ", ".join(sorted(ALLOWED_TARGETS[category]))
        raise _Bad(f"target type {target_type} is not allowed for category {category} (allowed: {allowed})")


def _strength_allowed(category: str, strength: str) -> None:
    if strength not in ALLOWED_STRENGTHS[category]:
        allowed = ", ".join(ALLOWED_STRENGTHS[category])
        raise _Bad(f"strength {strength} is not allowed for category {category} in v1 (allowed: {allowed})")


def _norm_target(target_type: str, value: Any) -> str:
    """A user's target value -> the normalised ``AffinityEntry.target`` string."""
    if target_type in _ID_TYPES:
        return _norm_id(target_type, value)
    return _NORM_TARGET.get(target_type, _norm_trust)(value)


def _norm_id(target_type: str, value: Any) -> str:
    if isinstance(value, uuid.UUID):
        return str(value)
    if not isinstance(value, str) or not value:
        raise _Bad(f"{target_type} must be a non-empty string id or UUID, not {value!r}")
    return str(id128(value))


def _norm_rack(value: Any) -> str:
    if isinstance(value, str) and _DECIMAL_RE.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
        raise _Bad(
            f"RackId must be an integer 0..4294967295 (u32) or a decimal string of one, not {value!r}"
        )
    return str(value)


def _norm_link_tier(value: Any) -> str:
    names = {v: k for k, v in LINK_TIER.items()}
    if isinstance(value, int) and not isinstance(value, bool) and value in names:
        return names[value]
    if isinstance(value, str) and value.upper() in LINK_TIER:
        return value.upper()
    raise _Bad(f"LinkTier must be one of {', '.join(LINK_TIER)} (or its code 1..6), not {value!r}")


def _norm_trust(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Bad(f"TrustDomain must be a non-empty string, not {value!r}")
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _Bad("TrustDomain must be valid UTF-8 text") from None
    if n > TRUST_DOMAIN_MAX:
        raise _Bad(f"TrustDomain is {n} UTF-8 bytes; at most {TRUST_DOMAIN_MAX}")
    return value


#: target type -> its value's normaliser (the id types: ``_norm_id``; any other: TrustDomain's)
_NORM_TARGET: dict[str, Callable[[Any], str]] = {"RackId": _norm_rack, "LinkTier": _norm_link_tier}


# -- wire form -------------------------------------------------------------------------------


def _entry_problems(e: AffinityEntry) -> list[str]:
    """Why an ``AffinityEntry`` cannot be encoded (not v1, or its target is not normalised)."""
    problems: list[str] = []
    cat = tt = strength = None
    for check, value in ((_category, e.category), (_strength, e.strength), (_target_type, e.target_type)):
        if not isinstance(value, str):
            problems.append(f"{value!r} is not a name")
            continue
        try:
            name = check(value)
        except _Bad as exc:
            problems.append(str(exc))
            continue
        if check is _category:
            cat = name
        elif check is _strength:
            strength = name
        elif check is _target_type:
            tt = name
    if not isinstance(e.anti, bool):
        problems.append(f"anti must be a bool, not {e.anti!r}")
    if cat is not None and tt is not None:
        try:
            _allowed(cat, tt)
        except _Bad as exc:
            problems.append(str(exc))
    if cat is not None and strength is not None:
        try:
            _strength_allowed(cat, strength)
        except _Bad as exc:
            problems.append(str(exc))
    if tt is not None:
        try:
            ok = isinstance(e.target, str) and _norm_target(tt, e.target) == e.target
        except _Bad as exc:
            problems.append(str(exc))
        else:
            if not ok:
                problems.append(f"target {e.target!r} is not normalised for {tt} (use normalize())")
    return problems


def _target_bytes(e: AffinityEntry) -> bytes:
    if e.target_type in _ID_TYPES:
        return uuid.UUID(e.target).bytes
    if e.target_type == "RackId":
        return int(e.target).to_bytes(4, "big")
    if e.target_type == "LinkTier":
        return bytes([LINK_TIER[e.target]])
    return e.target.encode("utf-8")


def encode_entry(e: AffinityEntry) -> bytes:
    """category u8, strength u8 (bit 7 = anti), target_type u8, target_len u16 BE, target.

    Raises ``ValueError`` for an entry that is not valid v1 or not normalised."""
    problems = _entry_problems(e)
    if problems:
        raise ValueError(f"cannot encode {e!r}: " + "; ".join(problems))
    target = _target_bytes(e)
    strength = STRENGTH[e.strength] | (ANTI_BIT if e.anti else 0)
    return (
        struct.pack(">BBBH", CATEGORY[e.category], strength, TARGET_TYPE[e.target_type], len(target)) + target
    )


def encode_tlv(entries: list[AffinityEntry]) -> bytes:
    """One TLV per entry: tag 0x0910 u16 BE, length u16 BE, entry."""
    out = bytearray()
    for e in entries:
        value = encode_entry(e)
        out += struct.pack(">HH", TLV_TAG, len(value)) + value
    return bytes(out)


def _expected_len(target_type: str) -> str | None:
    if target_type in _ID_TYPES:
        return "16 (u128 BE)"
    if target_type == "RackId":
        return "4 (u32 BE)"
    return None


def _decode_entry(value: bytes) -> AffinityEntry:
    """One affinity entry (a TLV's value), validated fail closed; raises ``_Bad``."""
    if len(value) < ENTRY_HEADER:
        raise _Bad(f"truncated entry: {len(value)} byte(s), an entry needs at least {ENTRY_HEADER}")
    cat_b, str_b, tt_b, tlen = struct.unpack_from(">BBBH", value)
    if len(value) != ENTRY_HEADER + tlen:
        raise _Bad(f"entry length {len(value)} != 5 + target_len {tlen}")
    if cat_b == FACILITY:
        raise _Bad(_FACILITY_MSG)
    if cat_b not in _CATEGORY_NAME:
        raise _Bad(f"unknown category 0x{cat_b:02x} (v1 categories: {_codes(CATEGORY)})")
    strength = str_b & ~ANTI_BIT
    if strength not in _STRENGTH_NAME:
        raise _Bad(f"unknown strength 0x{strength:02x} (byte 0x{str_b:02x}; strengths: {_codes(STRENGTH)})")
    if tt_b not in _TARGET_NAME:
        raise _Bad(f"unknown target type 0x{tt_b:02x} (target types: {_codes(TARGET_TYPE)})")
    category, target_type = _CATEGORY_NAME[cat_b], _TARGET_NAME[tt_b]
    _allowed(category, target_type)
    _strength_allowed(category, _STRENGTH_NAME[strength])
    if target_type == "LinkTier" and str_b & ANTI_BIT:
        raise _Bad(_LINK_TIER_ANTI)
    raw = value[ENTRY_HEADER:]
    if target_type in _ID_TYPES:
        if tlen != 16:
            raise _Bad(f"{target_type} target must be 16 bytes (u128 BE), got {tlen}")
        target = str(uuid.UUID(bytes=raw))
    elif target_type == "RackId":
        if tlen != 4:
            raise _Bad(f"RackId target must be 4 bytes (u32 BE), got {tlen}")
        target = str(int.from_bytes(raw, "big"))
    elif target_type == "LinkTier":
        if tlen != 1 or raw[0] not in LINK_TIER.values():
            raise _Bad(f"LinkTier target must be 1 byte, a tier code 1..6, got {raw.hex() or 'nothing'}")
        target = _norm_target("LinkTier", raw[0])
    else:
        if not 1 <= tlen <= TRUST_DOMAIN_MAX:
            raise _Bad(f"TrustDomain target must be 1..{TRUST_DOMAIN_MAX} bytes of UTF-8, got {tlen}")
        try:
            target = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Bad(f"TrustDomain target is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return AffinityEntry(category, _STRENGTH_NAME[strength], bool(str_b & ANTI_BIT), target_type, target)


def decode_tlv(data: bytes) -> list[AffinityEntry]:
    """All affinity entries of a TLV stream, in order; other tags are skipped.

    Fail closed: any malformed or not-v1 entry, or a truncated TLV, raises :class:`TLVError`
    (the only exception raised) naming the entry index (0-based, among affinity TLVs)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TLVError(f"TLV data must be bytes, not {type(data).__name__}")
    buf = bytes(data)
    entries: list[AffinityEntry] = []
    problems: list[str] = []
    off = index = 0
    while off < len(buf):
        left = len(buf) - off
        if left < 4:
            problems.append(f"truncated TLV header at offset {off}: {left} byte(s) left, a header needs 4")
            break
        tag, length = struct.unpack_from(">HH", buf, off)
        if length > left - 4:
            who = f"affinity entry {index}" if tag == TLV_TAG else f"TLV tag 0x{tag:04x}"
            problems.append(
                f"{who} (offset {off}): truncated TLV: length {length} but only {left - 4} byte(s) follow"
            )
            break
        if tag == TLV_TAG:
            try:
                entries.append(_decode_entry(buf[off + 4 : off + 4 + length]))
            except _Bad as exc:
                problems.append(f"affinity entry {index} (offset {off}): {exc}")
            index += 1
        off += 4 + length
    if problems:
        raise TLVError("; ".join(problems), problems)
    return entries


# -- JSON form, shorthand, normalisation -----------------------------------------------------


def _direction(item: dict[Any, Any], p: str, errors: list[SpecError]) -> bool:
    anti = item.get("anti", None)
    direction = item.get("direction", None)
    if anti is not None and not isinstance(anti, bool):
        errors.append(SpecError(f"{p}.anti", f"anti must be true or false, not {anti!r}"))
        anti = None
    if direction is not None:
        if direction not in ("away", "toward"):
            errors.append(
                SpecError(f"{p}.direction", f"direction must be 'away' or 'toward', not {direction!r}")
            )
        else:
            if anti is not None and anti != (direction == "away"):
                errors.append(
                    SpecError(
                        f"{p}.direction", f"direction {direction!r} contradicts anti: {str(anti).lower()}"
                    )
                )
            return direction == "away"
    return bool(anti)


def _from_json(item: Any, p: str, errors: list[SpecError]) -> AffinityEntry | None:
    """One JSON/YAML entry -> an ``AffinityEntry``; problems go to ``errors`` (None returned)."""
    if isinstance(item, AffinityEntry):
        item = {"category": item.category, "strength": item.strength, "anti": item.anti,
                "target": {"type": item.target_type, "value": item.target}}  # fmt: skip
    if not isinstance(item, dict):
        errors.append(
            SpecError(p, f"an affinity entry must be a mapping with {', '.join(_ENTRY_KEYS)}, not {item!r}")
        )
        return None
    before = len(errors)
    for key in item:
        if key not in _ENTRY_KEYS:
            errors.append(SpecError(f"{p}.{key}", f"unknown key {key!r} (allowed: {', '.join(_ENTRY_KEYS)})"))
    names = _names(item, p, errors)
    anti = _direction(item, p, errors)
    tt, value = _target(item, names["category"], p, errors)
    if tt == "LinkTier" and anti:
        errors.append(SpecError(f"{p}.anti", _LINK_TIER_ANTI))
    if len(errors) > before:
        return None
    assert names["category"] is not None and names["strength"] is not None and tt is not None
    return AffinityEntry(names["category"], names["strength"], anti, tt, value)


def _names(item: Mapping[str, object], p: str, errors: list[SpecError]) -> dict[str, str | None]:
    """An entry's category and strength, checked (None where missing or wrong) and allowed together."""
    names: dict[str, str | None] = {}
    for key, check in (("category", _category), ("strength", _strength)):
        if key not in item:
            errors.append(SpecError(f"{p}.{key}", f"missing {key}"))
            names[key] = None
            continue
        try:
            names[key] = check(item[key])
        except _Bad as exc:
            errors.append(SpecError(f"{p}.{key}", str(exc)))
            names[key] = None
    if names["category"] is not None and names["strength"] is not None:
        try:
            _strength_allowed(names["category"], names["strength"])
        except _Bad as exc:
            errors.append(SpecError(f"{p}.strength", str(exc)))
    return names


def _target(item: Mapping[str, object], category: str | None, p: str, errors: list[SpecError]) -> tuple[str | None, str]:
    """An entry's target: (its type, its normalised value); (None, "") with the errors when wrong."""
    target = item.get("target")
    if "target" not in item:
        errors.append(SpecError(f"{p}.target", "missing target ({type, value})"))
        return None, ""
    if not isinstance(target, dict):
        errors.append(SpecError(f"{p}.target", f"target must be a mapping {{type, value}}, not {target!r}"))
        return None, ""
    for key in target:
        if key not in _TARGET_KEYS:
            errors.append(SpecError(f"{p}.target.{key}", f"unknown key {key!r} (allowed: type, value)"))
    for key in _TARGET_KEYS:
        if key not in target:
            errors.append(SpecError(f"{p}.target.{key}", f"missing target {key}"))
    tt, value = None, ""
    if "type" in target:
        try:
            tt = _target_type(target["type"])
            if category is not None:
                _allowed(category, tt)
        except _Bad as exc:
            errors.append(SpecError(f"{p}.target.type", str(exc)))
    if tt is not None and "value" in target:
        try:
            value = _norm_target(tt, target["value"])
        except _Bad as exc:
            errors.append(SpecError(f"{p}.target.value", str(exc)))
    return tt, value


def _from_tlv(blob: Any, p: str, errors: list[SpecError]) -> list[AffinityEntry]:
    if not isinstance(blob, str):
        errors.append(SpecError(p, f"affinityTLV must be a base64 string, not {type(blob).__name__}"))
        return []
    try:
        data = base64.b64decode("".join(blob.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        errors.append(SpecError(p, f"affinityTLV is not valid base64: {exc}"))
        return []
    try:
        return decode_tlv(data)
    except TLVError as exc:
        errors.extend(SpecError(p, m) for m in exc.problems)
        return []


def normalize(
    affinity: Any = None,
    affinity_with: Any = None,
    anti_affinity_with: Any = None,
    affinity_tlv: Any = None,
    path: str = "$",
) -> list[AffinityEntry]:
    """JSON list form + shorthand + base64 TLV blob -> one internal list.

    Order: ``affinity`` entries, ``affinityWith``, ``antiAffinityWith``, then the TLV entries;
    identical entries are collapsed (first kept). Raises ``SpecInvalid`` listing every problem
    with a JSON path, including Required toward/away contradictions on the same target."""
    errors: list[SpecError] = []
    found: list[tuple[AffinityEntry, str, str]] = []  # entry, error path, where (for messages)
    if affinity is not None:
        p = f"{path}.affinity"
        if not isinstance(affinity, list | tuple):
            errors.append(SpecError(p, f"affinity must be a list of entries, not {type(affinity).__name__}"))
        else:
            for i, item in enumerate(affinity):
                e = _from_json(item, f"{p}[{i}]", errors)
                if e is not None:
                    found.append((e, f"{p}[{i}]", f"{p}[{i}]"))
    for value, key, category, anti in (
        (affinity_with, "affinityWith", "Resource", False),
        (anti_affinity_with, "antiAffinityWith", "Topology", True),
    ):
        if value is None:
            continue
        p = f"{path}.{key}"
        try:
            target = _norm_target("NodeId", value)
        except _Bad as exc:
            errors.append(SpecError(p, f"{key} names a node: {exc}"))
        else:
            found.append((AffinityEntry(category, "Preferred", anti, "NodeId", target), p, p))
    if affinity_tlv is not None:
        p = f"{path}.affinityTLV"
        found.extend((e, p, f"{p} entry {k}") for k, e in enumerate(_from_tlv(affinity_tlv, p, errors)))

    out: list[AffinityEntry] = []
    where: dict[AffinityEntry, tuple[str, str]] = {}
    for e, err_path, label in found:
        if e not in where:
            where[e] = (err_path, label)
            out.append(e)
    required: dict[tuple[str, str, bool], AffinityEntry] = {}
    for e in out:
        if e.strength != "Required":
            continue
        other = required.get((e.target_type, e.target, not e.anti))
        if other is not None:
            errors.append(
                SpecError(
                    where[e][0],
                    f"contradictory affinity: {other.describe()} ({where[other][1]}) and "
                    f"{e.describe()} ({where[e][1]}): no node can satisfy both",
                )
            )
        required.setdefault((e.target_type, e.target, e.anti), e)
    if errors:
        raise SpecInvalid(errors)
    return out
