"""The evaluator against a tiny independent model of the step semantics, and its numpy walk against it (hypothesis)."""

from __future__ import annotations

import json
import math
import operator

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from quantwatch.service.alerts.columns import evaluate_columns
from quantwatch.service.alerts.engine import batch_columns
from quantwatch.service.alerts.evaluator import (
    BatchColumns,
    SeriesState,
    SeriesStatus,
    SeriesTransition,
    StepInput,
    advance_episode,
    evaluate_batch,
)
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.batch import decode_json

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


def normalised(
    result: tuple[dict[tuple[str, str], SeriesState], list[SeriesTransition]],
) -> tuple[dict[tuple[str, str], tuple[object, ...]], list[tuple[object, ...]]]:
    """A result with NaN made comparable (NaN != NaN would fail equal results)."""

    def number(value: float | None) -> object:
        return "nan" if value is not None and math.isnan(value) else value

    changed, moved = result
    return (
        {key: (s.status, s.last_step, s.streak, s.clear_streak, number(s.last_value)) for key, s in changed.items()},
        [
            (t.rule, t.layer, t.rank, t.before, t.after, t.sample.step, t.sample.time, number(t.sample.value))
            for t in moved
        ],
    )


F32_THRESHOLD = float(np.float32(0.05))  # above 0.05 in float64, equal to it in float32: must breach `> 0.05`
wide_values = st.one_of(
    st.none(),
    st.sampled_from([0.0, 0.05, F32_THRESHOLD, 0.25, 0.5, 1.0, -1.0, math.nan, math.inf, -math.inf]),
)
column_rules = st.builds(
    lambda op, threshold, consecutive, keep, layers: Rule(
        name={">": "gt", ">=": "ge", "<": "lt", "<=": "le"}[op],
        metric="output_rel_l2",
        layers=layers,
        op=op,
        threshold=threshold,
        consecutive=consecutive,
        keep_firing_for=keep,
    ),
    st.sampled_from(sorted(OPS)),
    st.sampled_from([0.05, 0.5]),
    st.integers(1, 4),
    st.integers(0, 3),
    st.sampled_from(["*", "l[02]", "l1*", ["l0", "l2*"]]),
)
prior_states = st.one_of(
    st.none(),
    st.builds(
        SeriesState,
        st.sampled_from(list(SeriesStatus)),
        st.one_of(st.none(), st.integers(0, 20)),
        st.integers(0, 4),
        st.integers(0, 3),
        st.one_of(st.none(), st.just(0.3)),
    ),
)
LAYERS = ["l0", "l1", "l2", "l3"]
step_rows = st.lists(
    st.tuples(
        st.integers(0, 30),
        st.one_of(st.none(), st.lists(wide_values, min_size=len(LAYERS), max_size=len(LAYERS))),
        st.one_of(st.just({}), st.just({"loss": 2.2, "loss_shadow": 2.0}), st.just({"loss": 1.0, "loss_shadow": 0.0})),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=400, deadline=None)
@given(
    picked=st.lists(column_rules, min_size=1, max_size=3, unique_by=lambda rule: rule.name),
    priors=st.lists(prior_states, min_size=len(LAYERS), max_size=len(LAYERS)),
    batch_list=st.lists(st.tuples(st.integers(0, 2), step_rows), min_size=1, max_size=6),
)
def test_columns_match_per_sample_evaluation(
    picked: list[Rule],
    priors: list[SeriesState | None],
    batch_list: list[tuple[int, list[tuple[int, list[float | None] | None, dict[str, float]]]]],
) -> None:
    """The numpy walk gives exactly the per-sample walk's states and transitions, batch after batch and per rank."""
    scalar_rule = Rule(name="div", scalar="loss / loss_shadow - 1", op=">", threshold=0.05, consecutive=2)
    rule_set = [*picked, scalar_rule]
    states: dict[int, dict[tuple[str, str], SeriesState]] = {
        rank: {
            (rule.name, layer): prior
            for rule in picked
            for layer, prior in zip(LAYERS, priors, strict=True)
            if prior is not None
        }
        for rank in range(3)
    }
    for rank, rows in batch_list:
        steps = [
            StepInput(step, 1000.0 + step, {} if values is None else {"output_rel_l2": values}, scalars)
            for step, values, scalars in rows
        ]
        columns = BatchColumns.from_steps(len(LAYERS), steps, ["output_rel_l2"])
        expected = evaluate_batch(rule_set, "run", rank, LAYERS, steps, states[rank])
        got = evaluate_columns(rule_set, "run", rank, LAYERS, columns, states[rank])
        assert normalised(got) == normalised(expected)
        assert list(got[0]) == list(expected[0])
        states[rank] = {**states[rank], **expected[0]}


def test_columns_from_a_decoded_batch_mask_unmeasured_values() -> None:
    """Agent nulls are not samples, measured NaN is (and breaches), a metric absent from the batch is left out."""
    rule = Rule(name="dev", metric="output_rel_l2", op=">", threshold=0.05, consecutive=1)
    batch = decode_json(
        json.dumps(
            {
                "run": "r",
                "batch_id": "b",
                "layers": ["a", "b", "c"],
                "steps": [
                    {"step": 2, "metrics": {"output_rel_l2": [0.0, "nan", None]}},
                    {"step": 1, "time": 5.0, "metrics": {"output_rel_l2": [0.1, 0.0, 0.2]}},
                ],
            }
        ).encode()
    )
    columns = batch_columns(batch, ["output_rel_l2", "nonfinite_count"], now=9.0)
    assert set(columns.metrics) == {"output_rel_l2"}
    assert columns.times == (9.0, 5.0)
    changed, moved = evaluate_columns([rule], "r", 0, batch.layers, columns, {})
    assert [(t.layer, t.sample.step, t.after) for t in moved] == [
        ("a", 1, SeriesStatus.FIRING),
        ("a", 2, SeriesStatus.INACTIVE),
        ("b", 2, SeriesStatus.FIRING),
        ("c", 1, SeriesStatus.FIRING),
    ]
    assert changed[("dev", "c")].last_step == 1
