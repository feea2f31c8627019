"""Advice from the what-if statistics: per layer and tensor kind the cheapest candidate whose error stays within a
budget, the recipe that spells it (a ``quantwatch.kernels.Recipe``, a torchao ``module_filter_fn``, YAML) and the
``remediation`` sentence of an alert.

The budget bounds each tensor kind's ``rel_l2``: one number for every kind (``"0.05"``) or per kind
(``"weight=0.02,grad=0.1"``; a plain number among them sets the kinds not named, and a kind left without a bound
takes any candidate; bounds compare as float32, as the figures travel). A candidate's error is its worst ``rel_l2``
over the recent window of what-if steps; the cheapest is the one of fewest bits per element, then of lower error,
then by name. A tensor with no candidate
within its bound stays in high precision, and so does, for torchao, the whole layer holding it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from quantwatch.protocol import PRESETS, STOCHASTIC_SUFFIX, TENSOR_KINDS, candidate_bits, candidate_spec

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_WINDOW",
    "Choice",
    "LayerAdvice",
    "advise",
    "describe",
    "parse_budget",
    "recipe_python",
    "recipe_yaml",
    "remediation",
]

DEFAULT_BUDGET = 0.05
DEFAULT_WINDOW = 5
"""What-if steps the advice looks back over (the latest ones)."""

_KIND_WORDS = {"weight": "weights", "input": "inputs", "grad": "gradients"}


def parse_budget(text: str) -> dict[str, float | None]:
    """``{kind: bound or None}`` from ``"0.05"`` or ``"weight=0.02,grad=0.1"``; ValueError saying what is wrong."""
    bounds: dict[str, float | None] = dict.fromkeys(TENSOR_KINDS)
    named: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        kind, sep, number = part.rpartition("=")
        kind = kind.strip()
        if sep and kind not in TENSOR_KINDS:
            raise ValueError(f"unknown tensor kind {kind!r}; known: {', '.join(TENSOR_KINDS)}")
        try:
            bound = float(number)
        except ValueError:
            raise ValueError(f"{part!r} is not a number or KIND=NUMBER") from None
        if not bound >= 0 or math.isinf(bound):
            raise ValueError(f"{part!r}: a bound is a finite number >= 0")
        if sep:
            named[kind] = bound
        else:
            bounds = dict.fromkeys(TENSOR_KINDS, bound)
    bounds.update(named)
    return bounds


class Choice(NamedTuple):
    """A candidate for one tensor kind of a layer: its name, bits per element and worst ``rel_l2`` of the window."""

    candidate: str
    bits: int
    rel_l2: float


@dataclass(frozen=True)
class LayerAdvice:
    """One layer's choice per tensor kind (None: no candidate within the bound, keep it in high precision)."""

    layer: str
    kinds: Mapping[str, Choice | None]

    @property
    def high_precision(self) -> bool:
        """Whether some tensor of the layer stays in high precision."""
        return any(choice is None for choice in self.kinds.values())


def _worst(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, str], float]:
    """Worst ``rel_l2`` per (layer, kind, candidate) over the rows (unmeasured figures left out)."""
    worst: dict[tuple[str, str, str], float] = {}
    for row in rows:
        value = row["rel_l2"]
        if value is None:
            continue
        key = (row["layer"], row["kind"], row["candidate"])
        worst[key] = max(worst.get(key, value), value)
    return worst


def advise(rows: Iterable[Mapping[str, Any]], budget: Mapping[str, float | None]) -> list[LayerAdvice]:
    """Each layer's cheapest candidates within ``budget`` (layers in the rows' order; kinds the rows carry)."""
    by_layer: dict[str, dict[str, list[Choice]]] = {}
    for (layer, kind, candidate), value in _worst(rows).items():
        bits = candidate_bits(candidate)
        if bits is None:
            continue
        by_layer.setdefault(layer, {}).setdefault(kind, []).append(Choice(candidate, bits, value))
    out = []
    for layer, kinds in by_layer.items():
        chosen: dict[str, Choice | None] = {}
        for kind in TENSOR_KINDS:
            if kind not in kinds:
                continue
            bound = budget.get(kind)
            # The figures are float32 on the wire: the bound is too (0.05 stored is a little above 0.05).
            limit = math.inf if bound is None else float(np.float32(bound))
            fitting = [c for c in kinds[kind] if c.rel_l2 <= limit]
            chosen[kind] = min(fitting, key=lambda c: (c.bits, c.rel_l2, c.candidate)) if fitting else None
        out.append(LayerAdvice(layer, chosen))
    return out


def _glob(name: str) -> str:
    """A glob matching exactly ``name`` (its metacharacters bracketed)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _spec(candidate: str) -> str:
    fmt, scaling, rounding = candidate_spec(candidate)
    args = [json.dumps(fmt)]
    if scaling is not None:
        args.append(f"scaling={json.dumps(scaling)}")
    if rounding != "nearest":
        args.append(f"rounding={json.dumps(rounding)}")
    return f"QuantSpec({', '.join(args)})"


def _config(advice: LayerAdvice) -> str:
    if all(choice is None for choice in advice.kinds.values()):
        return "None"
    parts = [f"{kind}={'None' if c is None else _spec(c.candidate)}" for kind, c in advice.kinds.items()]
    return f"QuantConfig({', '.join(parts)})"


def _bounds_text(budget: Mapping[str, float | None]) -> str:
    return ", ".join(
        f"{kind} <= {bound:g}" if bound is not None else f"{kind} unbounded" for kind, bound in budget.items()
    )


def recipe_python(advice: Sequence[LayerAdvice], budget: Mapping[str, float | None], steps: Sequence[int]) -> str:
    """Python that builds the advised ``quantwatch.kernels.Recipe`` (``recipe``) and torchao's
    ``module_filter_fn`` (the layers some tensor of which stays in high precision are not converted)."""
    window = f"steps {steps[0]}-{steps[-1]}" if steps else "no what-if steps"
    lines = [
        "from quantwatch.kernels import QuantConfig, QuantSpec, Recipe",
        "",
        "# Per layer the cheapest what-if candidate whose rel_l2 stayed within the budget",
        f"# ({_bounds_text(budget)}) over {window}; None keeps that tensor in high precision.",
        "recipe = Recipe(",
        "    rules=[",
        *(f"        ({json.dumps(_glob(a.layer))}, {_config(a)})," for a in advice),
        "    ]",
        ")",
        "",
        f"HIGH_PRECISION = {json.dumps(sorted(a.layer for a in advice if a.high_precision))}",
        "",
        "",
        "def module_filter_fn(module, fqn):",
        '    """torchao: convert every linear layer but those the advice keeps in high precision."""',
        "    return fqn not in HIGH_PRECISION",
        "",
    ]
    return "\n".join(lines)


def recipe_yaml(advice: Sequence[LayerAdvice], budget: Mapping[str, float | None], steps: Sequence[int]) -> str:
    """The advice as YAML: the budget, the window's steps, each layer's format per kind, the high-precision
    layers (strings JSON-quoted, which YAML reads as they are)."""
    lines = [
        "budget: {" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in budget.items()) + "}",
        f"steps: {json.dumps(list(steps))}",
        "layers:" + ("" if advice else " {}"),
    ]
    for a in advice:
        kinds = ", ".join(
            f"{k}: {json.dumps('high_precision' if c is None else c.candidate)}" for k, c in a.kinds.items()
        )
        lines.append(f"  {json.dumps(a.layer)}: {{{kinds}}}")
    lines.append(f"high_precision: {json.dumps([a.layer for a in advice if a.high_precision])}")
    return "\n".join(lines) + "\n"


def describe(candidate: str) -> str:
    """A candidate in words: ``"NVFP4 blocks"``, ``"FP8 E4M3 with one scale per tensor"``."""
    base = candidate.removesuffix(STOCHASTIC_SUFFIX)
    rounding = " and stochastic rounding" if base != candidate else ""
    element, _, scaling = base.partition(":")
    if element in PRESETS:
        return f"{element.upper()} blocks{rounding}"
    words = element.upper().replace("_", " ")
    kind = scaling.rstrip("0123456789")
    size = scaling[len(kind) :]
    scaled = {
        "tensor": " with one scale per tensor",
        "block": f" in blocks of {size}",
        "nvblock": f" in two-level blocks of {size}",
        "channel": " with one scale per channel",
        "row": " with one scale per row",
    }.get(kind, f" ({scaling})" if scaling else "")
    return f"{words}{scaled}{rounding}"


def _share(value: float) -> str:
    percent = 100 * value
    return f"{percent:.0f}%" if percent >= 10 else f"{percent:.2g}%"


def remediation(
    layer: str, rows: Sequence[Mapping[str, Any]], budget: Mapping[str, float | None], window: int
) -> str | None:
    """The sentence an alert on ``layer`` carries, from the layer's what-if rows of the recent window; None without
    what-if statistics. It names the tensor kind whose own format errs most, what it loses there (underflow when
    more than 1% of its values flush to zero, else its relative error), the best candidate of each width, and the
    advice for every kind."""
    advice = advise(rows, budget)
    if not advice:
        return None
    latest = max(row["step"] for row in rows)
    now = [row for row in rows if row["step"] == latest and row["rel_l2"] is not None]
    own = [row for row in now if row["own"]]
    text = f"{layer}: "
    if own:
        worst = max(own, key=lambda row: row["rel_l2"])
        kind, underflow = worst["kind"], worst["underflow_ratio"]
        by_underflow = underflow is not None and underflow > 0.01
        stat = "underflow_ratio" if by_underflow else "rel_l2"

        def figure(row: Mapping[str, Any]) -> str:
            value = row[stat]
            return "?" if value is None else _share(value) if by_underflow else f"{value:.3g}"

        verb = "lose {} of their values to underflow" if by_underflow else "have a relative error of {}"
        text += f"its {_KIND_WORDS[kind]} {verb.format(figure(worst))} as {describe(worst['candidate'])}"
        best: dict[int, Mapping[str, Any]] = {}
        for row in now:
            bits = candidate_bits(row["candidate"])
            if row["kind"] != kind or row["own"] or bits is None or row[stat] is None:
                continue
            if bits not in best or row[stat] < best[bits][stat]:
                best[bits] = row
        others = [f"{describe(best[b]['candidate'])} {figure(best[b])}" for b in sorted(best)]
        if others:
            first = best[min(best)]
            others[0] = (
                f"{describe(first['candidate'])} {'would lose' if by_underflow else 'would have'} {figure(first)}"
            )
            text += "; " + ", ".join(others)
        text += ". "
    advised = ", ".join(
        f"{kind} {'high precision' if c is None else c.candidate}" for kind, c in advice[0].kinds.items()
    )
    return text + f"Advice ({_bounds_text(budget)}, last {window} what-if steps): {advised}."
