"""The evaluator against a tiny independent model of the step semantics (hypothesis)."""

from __future__ import annotations

import math
import operator

from hypothesis import given, settings
from hypothesis import strategies as st

from quantwatch.service.alerts.evaluator import (
    SeriesState,
    SeriesStatus,
    StepInput,
    advance_episode,
    evaluate_batch,
)
from quantwatch.service.alerts.rules import Rule

OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
THRESHOLD = 0.5

values = st.one_of(
    st.none(),
    st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, math.nan, math.inf, -math.inf]),
)
batches = st.lists(st.lists(st.tuples(st.integers(0, 30), values), min_size=1, max_size=6), min_size=1, max_size=12)
rules = st.builds(
    lambda op, consecutive, keep: Rule(
        name="r", metric="output_rel_l2", op=op, threshold=THRESHOLD, consecutive=consecutive, keep_firing_for=keep
    ),
    st.sampled_from(sorted(OPS)),
    st.integers(1, 4),
    st.integers(0, 3),
)


def reference_accepted(batch_list: list[list[tuple[int, float | None]]]) -> list[list[float]]:
    """Per batch, the values that count: measured, step newer than every step counted before."""
    newest = -1
    accepted = []
    for batch in batch_list:
        kept = []
        for step, value in sorted(batch, key=lambda item: item[0]):
            if value is not None and step > newest:
                kept.append(value)
                newest = step
        accepted.append(kept)
    return accepted


def reference_statuses(values_seen: list[float], rule: Rule) -> list[str]:
    """Status after each counted sample, from the definitions rather than a state machine."""
    breach = [not math.isfinite(v) or OPS[rule.op](v, rule.threshold) for v in values_seen]
    c, k = rule.consecutive, rule.keep_firing_for
    out = []
    for i in range(len(breach)):
        firing = False
        for j in range(c - 1, i + 1):
            if all(breach[j - c + 1 : j + 1]):
                run, longest = 0, 0
                for b in breach[j + 1 : i + 1]:
                    run = 0 if b else run + 1
                    longest = max(longest, run)
                if longest <= k:
                    firing = True
        out.append("firing" if firing else ("pending" if breach[i] else "inactive"))
    return out


def step_inputs(batch: list[tuple[int, float | None]]) -> list[StepInput]:
    return [StepInput(step, float(step), {"output_rel_l2": [value]}, {}) for step, value in batch]


@settings(max_examples=300, deadline=None)
@given(rule=rules, batch_list=batches)
def test_series_matches_reference(rule: Rule, batch_list: list[list[tuple[int, float | None]]]) -> None:
    state = SeriesState()
    seen: list[str] = []
    transitions = []
    for batch in batch_list:
        changed, moved = evaluate_batch([rule], "run", 0, ["l0"], step_inputs(batch), {("r", "l0"): state})
        state = changed.get(("r", "l0"), state)
        transitions.extend((t.before.value, t.after.value) for t in moved)
        seen.append(state.status.value)
    accepted = reference_accepted(batch_list)
    flat = [v for kept in accepted for v in kept]
    expected = reference_statuses(flat, rule)
    expected_transitions = [
        (before, after) for before, after in zip(["inactive", *expected], expected, strict=False) if before != after
    ]
    assert transitions == expected_transitions
    final = expected[-1] if expected else "inactive"
    assert state.status.value == final
    trailing = 0
    for v in reversed(flat):
        if not (not math.isfinite(v) or OPS[rule.op](v, rule.threshold)):
            break
        trailing += 1
    assert state.streak == trailing


@settings(max_examples=200, deadline=None)
@given(
    rule=rules,
    arrivals=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.tuples(st.integers(0, 20), values), min_size=1, max_size=5)),
        min_size=1,
        max_size=15,
    ),
)
def test_one_episode_across_ranks(rule: Rule, arrivals: list[tuple[int, list[tuple[int, float | None]]]]) -> None:
    """Episodes fire when the first rank fires and resolve when the last stops, once each."""
    states = {rank: SeriesState() for rank in range(3)}
    open_state = None
    fired = resolved = 0
    for rank, batch in arrivals:
        changed, moved = evaluate_batch([rule], "run", rank, ["l0"], step_inputs(batch), {("r", "l0"): states[rank]})
        statuses = {r: s.status for r, s in states.items()}
        for transition in moved:
            statuses[rank] = transition.after
            for event in advance_episode(open_state, statuses.values()):
                if event.kind == "open":
                    open_state = event.state
                    fired += event.state == "firing"
                elif event.kind == "fire":
                    open_state, fired = "firing", fired + 1
                else:
                    resolved += event.kind == "resolve"
                    open_state = None
        states[rank] = changed.get(("r", "l0"), states[rank])

    per_rank = {rank: [batch for r, batch in arrivals if r == rank] for rank in range(3)}
    statuses_ref = {
        rank: iter(reference_statuses([v for kept in reference_accepted(b) for v in kept], rule))
        for rank, b in per_rank.items()
    }
    accepted_ref = {rank: iter(reference_accepted(b)) for rank, b in per_rank.items()}
    current = dict.fromkeys(range(3), "inactive")
    any_firing, rises, falls = False, 0, 0
    for rank, _batch in arrivals:
        for _ in next(accepted_ref[rank]):
            current[rank] = next(statuses_ref[rank])
            now = "firing" in current.values()
            rises += now and not any_firing
            falls += any_firing and not now
            any_firing = now
    assert (fired, resolved) == (rises, falls)
    assert (open_state == "firing") == any_firing


def test_scalar_expression_needs_every_scalar() -> None:
    rule = Rule(name="div", scalar="loss / loss_shadow - 1", op=">", threshold=0.05, consecutive=2)
    steps = [
        StepInput(1, 1.0, {}, {"loss": 2.0}),
        StepInput(2, 2.0, {}, {"loss": 2.2, "loss_shadow": 2.0}),
        StepInput(3, 3.0, {}, {"loss": 2.0, "loss_shadow": 2.0}),
        StepInput(4, 4.0, {}, {"loss": 2.4, "loss_shadow": 2.0}),
        StepInput(5, 5.0, {}, {"loss": 1.0, "loss_shadow": 0.0}),
    ]
    changed, moved = evaluate_batch([rule], "run", 0, [], steps, {})
    assert [(t.after, t.sample.step) for t in moved] == [
        (SeriesStatus.PENDING, 2),
        (SeriesStatus.INACTIVE, 3),
        (SeriesStatus.PENDING, 4),
        (SeriesStatus.FIRING, 5),
    ]
    assert math.isinf(moved[-1].sample.value)
    assert changed[("div", "")].last_step == 5


def test_layer_and_run_globs_select_series() -> None:
    rule = Rule(
        name="g", metric="output_rel_l2", layers="blocks.*.attn*", runs="gpt-*", op=">", threshold=0.1, consecutive=1
    )
    layers = ["blocks.0.attn.qkv", "blocks.0.mlp.fc1", "head"]
    steps = [StepInput(7, 7.0, {"output_rel_l2": [0.2, 0.2, None]}, {})]
    changed, moved = evaluate_batch([rule], "gpt-fp4", 3, layers, steps, {})
    assert [(t.layer, t.rank, t.after) for t in moved] == [("blocks.0.attn.qkv", 3, SeriesStatus.FIRING)]
    assert set(changed) == {("g", "blocks.0.attn.qkv")}
    assert evaluate_batch([rule], "llama", 0, layers, steps, {}) == ({}, [])
