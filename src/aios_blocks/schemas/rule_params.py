"""The parameters and settings that the framework and the built-ins read from an ``autoscaler`` or a
``stabilityChecker`` rule, checked where the rule is given (``blocks component add``, the parser):
a rule that could only fail every tick of the block's autoscaler or health checker (one reason at a
time, seen in ``blocks explain``) is refused with all of its problems at once instead
(docs/autoscaling.md, docs/health.md, docs/policies.md).

The run-time checks stay (``handlers/autoscale.Params``, ``builtin:probe-threshold``): they also
cover the ``AIOS_AUTOSCALE_*`` settings and rules stored before this check. What they accept
(numeric strings in the probe-threshold's settings, say) is accepted here too.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping

#: the framework's autoscaling rules' parameters (any autoscaler policy): name -> (lowest, lowest allowed?, below)
AUTOSCALE_PARAMETERS: dict[str, tuple[float, bool, float]] = {
    "tolerance": (0.0, True, 1.0),
    "upscaleDelayS": (0.0, True, math.inf),
    "downscaleDelayS": (0.0, True, math.inf),
    "stableWindowS": (0.0, False, math.inf),
    "burstWindowS": (0.0, False, math.inf),
    "burstThreshold": (1.0, False, math.inf),
    "maxUpFactor": (1.0, False, math.inf),
    "maxDownFactor": (1.0, False, math.inf),
}
#: a built-in autoscaler's own parameters (each a number > 0)
AUTOSCALE_BUILTIN_PARAMETERS: dict[str, tuple[str, ...]] = {
    "builtin:target-inflight": ("target",),
    "builtin:queue-depth": ("target", "runningTarget"),
}
#: the checker's settings of any stabilityChecker rule (docs/health.md)
HEALTH_SETTINGS = ("startupGraceS", "probePath", "probe")
#: ``builtin:probe-threshold``'s settings: name -> (integer?, lowest, lowest allowed?, highest)
PROBE_THRESHOLD_SETTINGS: dict[str, tuple[bool, float, bool, float]] = {
    "failureThreshold": (True, 1, True, math.inf),
    "successThreshold": (True, 1, True, math.inf),
    "restartThreshold": (True, 1, True, math.inf),
    "maxRestarts": (True, 0, True, math.inf),
    "stallS": (False, 0, False, math.inf),
    "slowFactor": (False, 0, False, math.inf),
    "recoverFactor": (False, 0, False, math.inf),
    "minWeight": (False, 0, False, 1),
}


def _range(lo: float, lo_in: bool, hi: float, hi_in: bool) -> str:
    if hi == math.inf:
        return f"{'>=' if lo_in else '>'} {lo:g}"
    return f"in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"


def _number(key: str, v: object, lo: float, lo_in: bool, hi: float, hi_in: bool,
            strings: bool = False, integer: bool = False) -> str | None:
    """Why ``v`` is not a number in the range (None when it is). ``strings``: a numeric string
    counts (what ``as_float`` / ``as_int`` read); ``integer``: a whole number."""
    want = f"{'a whole number' if integer else 'a number'} {_range(lo, lo_in, hi, hi_in)}"
    x: float | None = None
    if isinstance(v, int | float) and not isinstance(v, bool):
        x = float(v)
    elif strings and isinstance(v, str):
        try:
            x = float(int(v)) if integer else float(v)
        except ValueError:
            x = None
    if x is None or not math.isfinite(x):
        return f"{key} must be {want}, got {v!r}"
    if (integer and x != int(x)) or x < lo or (x == lo and not lo_in) or x > hi or (x == hi and not hi_in):
        return f"{key} must be {want}, got {v!r}"
    return None


def _unknown(where: str, given: Mapping[str, object], known: tuple[str, ...], uri: str) -> list[str]:
    out = []
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            out.append(f"unknown {where} {key!r} for {uri} ({hint}known: {', '.join(known)})")
    return out


def autoscaler_problems(uri: str, parameters: Mapping[str, object]) -> list[str]:
    """Every problem of an autoscaler rule's ``parameters``: the framework's rules' parameters
    (any policy), a built-in's own (``target``, ``runningTarget``) and, for a built-in, unknown keys."""
    out = [p for key, (lo, lo_in, hi) in AUTOSCALE_PARAMETERS.items()
           if key in parameters and (p := _number(key, parameters[key], lo, lo_in, hi, False))]
    stable, burst = parameters.get("stableWindowS"), parameters.get("burstWindowS")
    if (isinstance(stable, int | float) and isinstance(burst, int | float) and not isinstance(stable, bool)
            and not isinstance(burst, bool) and 0 < stable < burst):
        out.append(f"burstWindowS ({burst:g} s) must not exceed stableWindowS ({stable:g} s)")
    own = AUTOSCALE_BUILTIN_PARAMETERS.get(uri)
    if own is not None:
        out += [p for key in own if key in parameters and (p := _number(key, parameters[key], 0, False, math.inf, False))]
        out += _unknown("parameter", parameters, (*AUTOSCALE_PARAMETERS, *own), uri)
    return out


def stability_problems(uri: str, settings: Mapping[str, object]) -> list[str]:
    """Every problem of a stabilityChecker rule's ``settings``: the checker's (``startupGraceS``,
    ``probePath``, ``probe``, any policy) and ``builtin:probe-threshold``'s, with its unknown keys."""
    out = []
    if "startupGraceS" in settings and (p := _number("startupGraceS", settings["startupGraceS"], 0, True, math.inf, False, True)):
        out.append(p)
    path = settings.get("probePath")
    if path is not None and not (isinstance(path, str) and path.startswith("/")):
        out.append(f"probePath must be a path starting with '/', got {path!r}")
    if "probe" in settings and not isinstance(settings["probe"], bool):
        out.append(f"probe must be true or false, got {settings['probe']!r}")
    if uri == "builtin:probe-threshold":
        for key, (integer, lo, lo_in, hi) in PROBE_THRESHOLD_SETTINGS.items():
            if key in settings and (p := _number(key, settings[key], lo, lo_in, hi, True, True, integer)):
                out.append(p)
        fail, restart = settings.get("failureThreshold", 3), settings.get("restartThreshold", 6)
        if (isinstance(fail, int) and isinstance(restart, int) and not isinstance(fail, bool)
                and not isinstance(restart, bool) and 1 <= restart < fail):
            out.append(f"restartThreshold ({restart}) must not be below failureThreshold ({fail})")
        out += _unknown("setting", settings, (*HEALTH_SETTINGS, *PROBE_THRESHOLD_SETTINGS), uri)
    return out


def rule_problems(name: str, uri: str, parameters: Mapping[str, object], settings: Mapping[str, object]) -> list[str]:
    """Every problem of one rule's ``parameters`` / ``settings`` that its framework or built-in
    reads (autoscaler and stabilityChecker rules; none for the other kinds)."""
    if name == "autoscaler" and (problems := autoscaler_problems(uri, parameters)):
        return [f"parameters: {'; '.join(problems)}"]
    if name == "stabilityChecker" and (problems := stability_problems(uri, settings)):
        return [f"settings: {'; '.join(problems)}"]
    return []
