"""The autoscaler's framework rules (handlers/autoscale.py) on a fake clock, the autoscale contract
and the built-in autoscaler policies; no servers."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from aios_blocks.handlers import autoscale as a
from aios_blocks.policies import contract, uris
from aios_blocks.policies.builtin.autoscale import QueueDepthPolicy, TargetInflightPolicy
from aios_blocks.policies.runtime import BUILTINS, PolicyRuntime
from aios_blocks.schemas.errors import PolicyFailed

P = a.Params()  # the defaults: tolerance 0.1, up 2 s, down 30 s, stable 60 s, burst 6 s x2, up x4, down /2
TICK = 2.0


def run(proposals: list[float], current: int, lo: int = 1, hi: int = 100, p: a.Params = P, t0: float = 1000.0,
        state: a.State | None = None, follow: bool = True) -> tuple[list[a.Outcome], a.State, list[int]]:
    """Tick every 2 s with these proposals; the count follows each decision at once (``follow``)."""
    st = state or a.State(gen=1)
    outs, counts = [], []
    for i, raw in enumerate(proposals):
        out, st = a.decide(t0 + i * TICK, current, raw, lo, hi, p, st)
        outs.append(out)
        if follow:
            current = out.desired
        counts.append(current)
    return outs, st, counts


def reversals(counts: list[int]) -> int:
    moves = [1 if b > a_ else -1 for a_, b in itertools.pairwise(counts) if b != a_]
    return sum(1 for x, y in itertools.pairwise(moves) if x != y)


def filled(value: float, seconds: float = 60.0, t0: float = 1000.0) -> a.State:
    """A state whose history holds ``value`` for the last ``seconds`` before ``t0``."""
    n = int(seconds / TICK)
    return a.State(gen=1, history=[(t0 - (n - i) * TICK, value) for i in range(n)])


# -- bounds -------------------------------------------------------------------------------------------
def test_bounds_clamp_the_proposal_and_are_named() -> None:
    out, _ = a.decide(1000, 5, 500, 1, 8, a.Params(upscale_delay_s=0), filled(8))
    assert out.proposal == 8 and out.desired == 8
    assert any(r.startswith("bounds: proposal 500 clamped to 8") for r in out.rules)
    out, _ = a.decide(1000, 3, 0, 3, 8, P, filled(3))
    assert out.proposal == 3 and out.desired == 3 and not out.changed


def test_a_count_outside_new_bounds_comes_back_inside() -> None:
    out, _ = a.decide(1000, 12, 12, 1, 8, P, filled(12))
    assert out.desired <= 8 and out.changed


# -- tolerance ------------------------------------------------------------------------------------------
def test_changes_within_the_tolerance_band_are_ignored() -> None:
    out, _ = a.decide(1000, 10, 10.9, 1, 100, P, filled(10.9))
    assert not out.changed and any(r.startswith("tolerance") for r in out.rules)
    out, _ = a.decide(1000, 10, 9.2, 1, 100, P, filled(9.2))
    assert not out.changed
    # beyond the band (and past the delay) it changes
    out, _ = a.decide(1000, 10, 11.5, 1, 100, a.Params(upscale_delay_s=0), filled(11.5))
    assert out.desired == 12


# -- delays ---------------------------------------------------------------------------------------------
def test_upscale_waits_until_the_larger_count_was_wanted_for_the_delay() -> None:
    p = a.Params(upscale_delay_s=4, burst_threshold=10)  # no burst: the delay rule alone
    outs, _, counts = run([15] * 4, current=10, p=p, state=filled(15))
    assert [o.desired for o in outs[:2]] == [10, 10] and all("upscale delay" in o.rules[0] for o in outs[:2])
    assert counts[2] == 15  # wanted at t, t+2, t+4: 4 s held


def test_a_dip_restarts_the_upscale_delay() -> None:
    p = a.Params(upscale_delay_s=4, burst_threshold=10, stable_window_s=1, burst_window_s=1)
    outs, _, counts = run([15, 15, 10, 15, 15, 15], current=10, p=p, state=a.State(gen=1))
    assert counts[:5] == [10] * 5 and counts[5] == 15


def test_downscale_waits_for_the_down_delay_and_no_shrink_before() -> None:
    p = a.Params(downscale_delay_s=30, stable_window_s=6, burst_window_s=2)
    outs, _, counts = run([5] * 20, current=10, p=p, state=a.State(gen=1))
    first = next(i for i, c in enumerate(counts) if c < 10)
    assert first * TICK >= 30 and first * TICK <= 30 + TICK
    assert counts[first] == 6  # ceil(5 * 1.1): shrinking keeps the tolerance as headroom
    assert all("downscale delay" in o.rules[0] for o in outs[:first])


# -- stable and burst windows -------------------------------------------------------------------------
def test_a_burst_grows_at_once_without_the_up_delay() -> None:
    p = a.Params(upscale_delay_s=30)
    out, _ = a.decide(1000, 2, 20, 1, 100, p, filled(2))
    # the burst window (6 s: 3 old samples + this one) has mean (2+2+2+20)/4 = 6.5 >= 2 x 2
    assert out.in_burst and out.desired == 7 and out.rules[0].startswith("burst")


def test_no_scale_down_during_a_burst_and_for_a_stable_window_after() -> None:
    p = a.Params(downscale_delay_s=0, stable_window_s=20, burst_window_s=4)
    # a burst (load 10x), then the load goes to zero at once
    outs, st, counts = run([20] * 3 + [1] * 30, current=2, p=p, state=filled(2, 20))
    assert max(counts) >= 8
    top = counts.index(max(counts))
    burst_ends = max(i for i, o in enumerate(outs) if o.in_burst and o.burst >= 2 * o.current)
    never_down_until = burst_ends + int(20 / TICK)
    assert all(counts[i] >= counts[i - 1] for i in range(1, min(never_down_until, len(counts))))
    assert counts[-1] < max(counts) and top < never_down_until


def test_the_stable_window_smooths_the_proposals() -> None:
    # a single high sample in a full window of 10s does not move a block of 10 (mean 10.5)
    st = filled(10, 58)
    out, _ = a.decide(1000, 10, 40, 1, 100, a.Params(burst_threshold=100), st)
    assert out.stable == pytest.approx((29 * 10 + 40) / 30, abs=0.01) and not out.changed


# -- rate limits ------------------------------------------------------------------------------------------
def test_rate_limits_per_step_up_and_down() -> None:
    out, _ = a.decide(1000, 2, 100, 1, 100, P, filled(100))
    assert out.desired == 8 and any(r.startswith("rate limit up") for r in out.rules)
    out, _ = a.decide(1000, 1, 100, 0, 100, P, a.State(gen=1))
    assert out.desired == 4
    out, _ = a.decide(1000, 0, 3, 0, 100, P, a.State(gen=1))
    assert out.desired == 1  # from zero: one step of +1 (the activator's business to be quicker)
    p = a.Params(downscale_delay_s=0)
    out, _ = a.decide(1000, 20, 1, 1, 100, p, filled(1))
    assert out.desired == 10 and any(r.startswith("rate limit down") for r in out.rules)
    out, _ = a.decide(1000, 3, 0, 1, 100, p, filled(0))
    assert out.desired == 1  # floor(3 / 2) = 1
    out, _ = a.decide(1000, 1, 0, 0, 100, p, filled(0))
    assert out.desired == 0  # at least one per step may go


# -- whole scenarios ----------------------------------------------------------------------------------------
def test_steady_load_within_10_percent_makes_no_reversals() -> None:
    rnd = random.Random(7)
    for mean_inflight in (5, 11, 40, 200):
        # the built-in's proposal: ceil(in flight / 2) with the in-flight count wobbling +-10 %
        proposals = [math.ceil(mean_inflight * rnd.uniform(0.9, 1.1) / 2) for _ in range(600)]
        _, _, counts = run(proposals, current=1, hi=1000)
        assert reversals(counts) == 0, (mean_inflight, counts)
        tail = counts[len(counts) // 2:]
        assert max(tail) == min(tail)  # settled: no change at all once grown


def test_load_to_zero_returns_to_min_after_the_down_delay() -> None:
    p = a.Params()
    t0 = 1000.0
    proposals = [10] * 60 + [0] * 120  # 2 min at 10, then 4 min of nothing
    outs, _, counts = run(proposals, current=10, lo=2, p=p, t0=t0, state=filled(10, 60, t0))
    drop = 60
    first_down = next(i for i in range(drop, len(counts)) if counts[i] < 10)
    assert (first_down - drop) * TICK >= p.downscale_delay_s
    at_min = next(i for i in range(drop, len(counts)) if counts[i] == 2)
    assert (at_min - drop) * TICK <= p.stable_window_s + p.downscale_delay_s
    assert counts[-1] == 2 and reversals(counts) == 0


def test_ten_fold_step_is_decided_on_the_first_tick_and_reaches_the_need() -> None:
    outs, _, counts = run([2] * 30 + [20] * 10, current=2, state=filled(2))
    assert counts[30] > 2  # the first tick that sees the step acts
    assert counts[-1] == 20 and reversals(counts) == 0


# -- failures ------------------------------------------------------------------------------------------------
def test_failed_ticks_are_stored_once_per_window_unless_the_reason_changes() -> None:
    st = a.State(gen=1)
    store, st = a.failed(1000, st, "raised KeyError", 60)
    assert store
    stored = [a.failed(1000 + i, st, "raised KeyError", 60)[0] for i in range(1, 59)]
    assert not any(stored)
    _, st = a.failed(1010, st, "raised KeyError", 60)
    assert st.failed_quiet == 1
    assert a.failed(1011, st, "timed out after 1s", 60)[0]  # a new reason is stored at once
    assert a.failed(1060, st, "raised KeyError", 60)[0]
    assert a.recovered(st).failed_reason == ""


# -- parameters ---------------------------------------------------------------------------------------------
def test_rule_parameters_override_the_settings() -> None:
    p = a.Params().with_parameters({"upscaleDelayS": 0, "downscaleDelayS": 5, "tolerance": 0.2, "target": 3})
    assert p.upscale_delay_s == 0 and p.downscale_delay_s == 5 and p.tolerance == 0.2
    from aios_blocks.settings import Settings

    s = Settings(autoscale_downscale_delay_s=12)
    assert a.Params.from_settings(s).downscale_delay_s == 12


@pytest.mark.parametrize("params, word", [
    ({"tolerance": "lots"}, "tolerance must be a number"),
    ({"tolerance": 1.5}, "tolerance must be in [0, 1)"),
    ({"downscaleDelayS": -1}, "downscale_delay_s must be >= 0"),
    ({"burstWindowS": 90}, "must not exceed the stable window"),
    ({"maxUpFactor": 1}, "maxUpFactor and maxDownFactor must be > 1"),
    ({"burstThreshold": True}, "burstThreshold must be a number"),
])
def test_bad_parameters_are_refused_with_the_reason(params: dict[str, Any], word: str) -> None:
    with pytest.raises(a.BadParameters, match=None) as err:
        a.Params().with_parameters(params)
    assert word in str(err.value)


# -- the contract and the built-ins --------------------------------------------------------------------------
@pytest.mark.parametrize("result", [None, {}, {"desired": "3"}, {"desired": -1}, {"desired": float("nan")},
                                    {"desired": True}, {"desired": 2, "reason": 7}, [3]])
def test_autoscale_answers_of_the_wrong_shape_are_refused(result: Any) -> None:
    with pytest.raises(contract.WrongShape):
        contract.check("autoscale", result)


def test_autoscale_answers_of_the_right_shape_pass() -> None:
    contract.check("autoscale", {"desired": 3})
    contract.check("autoscale", {"desired": 2.5, "reason": "queue"})
    assert a.read_answer({"desired": 3, "reason": "x"}) == (3.0, "x")


def _input(**bm: Any) -> dict[str, Any]:
    return a.policy_input("b1", {}, bm, 2, 1, 10, a.State())


def test_target_inflight_is_ongoing_over_target() -> None:
    pol = TargetInflightPolicy("b1.autoscaler", {}, {})
    assert pol.eval({}, _input(inflight=7.0, queue=0.0), {})["desired"] == 4  # ceil(7 / 2), Ray's default target 2
    assert pol.eval({"target": 5}, _input(inflight=7.0, queue=3.0), {})["desired"] == 2
    assert pol.eval({}, _input(inflight=0.0), {})["desired"] == 0
    assert pol.eval({}, _input(), {})["desired"] == 0
    with pytest.raises(ValueError, match="target must be a number > 0"):
        pol.eval({"target": 0}, _input(inflight=1.0), {})


def test_queue_depth_is_waiting_over_target_with_a_running_floor() -> None:
    pol = QueueDepthPolicy("b1.autoscaler", {}, {})
    assert pol.eval({}, _input(waiting=10.0, queue=2.0, running=4.0), {})["desired"] == 3  # ceil(12 / 4)
    assert pol.eval({}, _input(waiting=0.0, running=20.0), {})["desired"] == 3  # ceil(20 / 8): busy, nothing waits
    assert pol.eval({}, _input(inflight=9.0), {})["desired"] == 2  # engines report nothing: in flight counts as running
    assert pol.eval({"target": 1, "runningTarget": 100}, _input(waiting=3.0, running=4.0), {})["desired"] == 3


def test_builtins_fill_only_the_autoscaler_slot() -> None:
    for uri in ("builtin:target-inflight", "builtin:queue-depth"):
        assert uri in BUILTINS and uris.BUILTIN_KINDS[uri] == ("autoscaler",)
        assert uris.uri_problem(uri, "autoscaler") is None
        assert "not a loadBalancer one" in (uris.uri_problem(uri, "loadBalancer") or "")


async def test_the_runtime_fails_a_builtin_call_with_bad_parameters_and_checks_shapes() -> None:
    rt = PolicyRuntime(timeout_s=1)
    rule = {"name": "autoscaler", "policyRuleURI": "builtin:target-inflight", "parameters": {"target": -2}}
    with pytest.raises(PolicyFailed, match="target must be a number > 0"):
        await rt.invoke(rule, "b1.autoscaler", _input(inflight=3.0))
    rule["parameters"] = {"target": 1}
    assert (await rt.invoke(rule, "b1.autoscaler", _input(inflight=3.0)))["desired"] == 3


# -- blocks explain --------------------------------------------------------------------------------------
def test_explain_lists_decisions_failures_and_targets_and_renders_them() -> None:
    from aios_blocks.cli import main as cli
    from aios_blocks.projections.explain import explain

    def ev(kind: str, t: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return f"aios.block.bx.{kind}", {"time": f"2026-11-25T20:00:{t}Z", "data": data}

    events = [
        ev("autoscaled", "01", block_id="bx", gen=1, request_id="as1-1", current=1, desired=4, raw=10, rules=["burst: ..."],
           reason="20 ongoing", in_burst=True, inputs={"inflight": 20}),
        ev("scale.target", "01", block_id="bx", request_id="as1-1", target=4, source="autoscaler", reason="autoscaler: 1 -> 4"),
        ev("autoscale.failed", "09", block_id="bx", gen=1, request_id="asf2-1", reason="raised KeyError", current=4, quiet=3),
        ev("scale.target", "20", block_id="bx", request_id="cli-1", target=2, source="cli", reason="by hand"),
        ev("autoscaled", "40", block_id="bx", gen=1, request_id="as3-1", current=2, desired=1, raw=0, rules=["downscale delay: ..."],
           reason="0 ongoing"),
    ]
    x = explain(events)
    assert [(d["from"], d["to"], d["proposal"], d["reason"]) for d in x["autoscaler"]["decisions"]] == [
        (1, 4, 10, "20 ongoing"), (2, 1, 0, "0 ongoing")]
    assert x["autoscaler"]["failures"] == [{"time": "2026-11-25T20:00:09Z", "reason": "raised KeyError", "count": 4, "quiet": 3}]
    assert [(t["target"], t["source"]) for t in x["targets"]] == [(4, "autoscaler"), (2, "cli")]
    with cli.console.capture() as cap:
        cli._render_explain(x)
    text = cap.get()
    assert "autoscaler decisions" in text and "1 -> 4" in text and "raised KeyError" in text and "asked by cli" in text


def test_explain_keeps_an_instances_failure_after_it_is_replaced() -> None:
    # the agent's "exited with code 137" was overwritten by the later removed's "reassigned to ..."
    from aios_blocks.cli import main as cli
    from aios_blocks.projections.explain import explain

    def ev(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return f"aios.block.bx.{kind}", {"time": "2026-11-25T20:00:01Z", "data": data}

    x = explain([
        ev("instance.bx-0.added", block_id="bx", gen=1, instance_id="bx-0", node_id="n0"),
        ev("instance.bx-0.unhealthy", block_id="bx", gen=1, instance_id="bx-0", node_id="n0", reason="probe failed 3 times"),
        ev("instance.bx-0.failed", block_id="bx", gen=1, instance_id="bx-0", node_id="n0", reason="exited with code 137"),
        ev("instance.bx-0.removed", block_id="bx", gen=1, instance_id="bx-0", node_id="n0", reason="reassigned to bx-1"),
    ])
    inst = x["instances"]["bx-0"]
    assert inst["status"] == "removed" and inst["reason"] == "reassigned to bx-1"
    assert inst["failures"] == [{"event": "unhealthy", "reason": "probe failed 3 times"},
                                {"event": "failed", "reason": "exited with code 137"}]
    assert {"step": "instance bx-0", "reason": "exited with code 137"} in x["failures"]
    with cli.console.capture() as cap:
        cli._render_explain(x)
    assert "instance bx-0 failed: exited with code 137" in cap.get()


def test_timed_out_calls_back_off_exponentially_up_to_a_minute() -> None:
    st = a.State(gen=1)
    waits = []
    for _ in range(8):
        st = a.timed_out(1000.0, st, 2.0)
        waits.append(st.backoff_until - 1000.0)
    assert waits == [4, 8, 16, 32, 60, 60, 60, 60] and st.timeouts == 8
    assert a.recovered(st).timeouts == 0 and a.recovered(st).backoff_until == 0


def test_blocks_top_shows_the_autoscalers_latest_tick() -> None:
    import io

    from rich.console import Console

    from aios_blocks.cli import top

    def text(latest: dict[str, Any]) -> str:
        out = io.StringIO()
        Console(file=out, width=250).print(top.table({"block": {"t": 100.0}, "instances": {}, "autoscaler": latest}, "bx", now=101.0))
        return out.getvalue()

    held = text({"t": 100.0, "current": 3, "raw": 3.4, "desired": 3, "rules": ["tolerance: stable mean 3.20 within 10% of 3"],
                 "reason": "6.8 ongoing"})
    assert "autoscaler (1s ago): stays 3, proposal 3.4 (6.8 ongoing); tolerance" in held
    assert "1 -> 4" in text({"t": 100.0, "current": 1, "raw": 10, "desired": 4, "rules": [], "reason": ""})
    assert "tick failed, count stays 2: autoscaler policy registry:p raised" in text(
        {"t": 100.0, "current": 2, "failed": "autoscaler policy registry:p raised KeyError"})


def test_blocks_split_among_copies_and_a_leaving_copy_moves_only_its_share() -> None:
    from aios_blocks.workers.autoscaler import owner

    bids = [f"b{i}" for i in range(600)]
    three = {b: owner(b, ["x1", "x2", "x3"]) for b in bids}
    counts = {c: sum(1 for o in three.values() if o == c) for c in ("x1", "x2", "x3")}
    assert all(150 < n < 250 for n in counts.values()), counts
    two = {b: owner(b, ["x1", "x3"]) for b in bids}
    assert all(two[b] == three[b] for b in bids if three[b] != "x2")  # only x2's share moved
    assert owner("b1", []) == ""


def test_a_saved_state_decodes_with_its_typed_decisions_and_encodes_to_the_same_bytes() -> None:
    """``State.last`` / ``State.latest`` are TypedDicts now (msgspec decodes them by name): a state
    saved before (every kind of latest tick, decisions with and without their reason) reads back
    and is written again byte for byte, and a latest tick of the wrong shape is refused (the
    autoscaler then starts the block afresh, ``workers.autoscaler._state_of``)."""
    import msgspec

    saved = [
        b'{"gen":3,"history":[[1.0,2.0]],"seq":2,"last":[{"t":1.5,"from":1,"to":2},{"t":9.0,"from":2,"to":3,"reason":"q",'
        b'"request_id":"as2-9000"}],"latest":{"t":9.0,"current":2,"raw":3.0,"desired":3,"stable":2.5,"burst":0.0,'
        b'"in_burst":false,"rules":["r"],"reason":"q","waiting":"target 3 asked 1 s ago"}}',
        b'{"gen":1,"latest":{"t":2.0,"current":1,"skipped":"no fresh metrics"}}',
        b'{"gen":1,"failed_reason":"x","failed_quiet":2,"latest":{"t":2.0,"current":1,"failed":"x"}}',
    ]
    for raw in saved:
        state = msgspec.json.decode(raw, type=a.State)
        assert msgspec.json.encode(state) == raw
    assert msgspec.json.decode(saved[0], type=a.State).last[1]["request_id"] == "as2-9000"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"gen":1,"latest":{"t":"soon"}}', type=a.State)
