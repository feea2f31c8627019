"""Text-format spelling of float32 figures at C speed: the value column of the exposition's sample lines.

A float32 figure is exported as the shortest decimal that reads back as the same float32 (0.1, not
0.10000000149011612), spelled the way prometheus_client's ``floatToGoString`` spells the float64 of that decimal
(Python's ``repr``). numpy finds that decimal (Dragon4) at about 0.7 µs a value and ``repr`` spells a float at about
0.3 µs: most of a scrape when every run changed. Here both steps are vectorised.

Finding the decimal: a decimal of ``p`` significant digits is an integer ``c`` times ``10**-s``; the candidate
nearest the figure is ``rint(figure * 10**s)``, and it is the answer if it reads back as the figure and no shorter
one does. Each step rounds once, with powers of ten that are exact in float64, so the arithmetic agrees with the
exact decimal wherever it makes a choice. Where it cannot be sure (a candidate within 1e-6 of a tie that the
arithmetic does not hold exactly, a candidate whose float64 is a float32 rounding boundary), and outside the range
where it holds (non-finite values, magnitudes below 1e-13, from 1e6 where Go-style exponents start), the value takes
numpy's own path. Powers of two, whose rounding interval is lopsided, are looked up in a table that numpy spelled.

Spelling it: ``repr`` lays out a decimal by its sign, the exponent of its first digit and its number of digits
alone. A table holds, for each such shape, which of the decimal's digits or which constant character goes in each
column; one gather per value lays out the text.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from prometheus_client.utils import floatToGoString

__all__ = ["float32_value_lines"]

# The text format's spelling of a float (+Inf, NaN, Go-style exponents); prometheus_client leaves it untyped.
_go_float = cast("Callable[[float], str]", floatToGoString)

# The fast path's range: from 1e-13 every power of ten it scales by (at most 10**22) is exact in float64; below 1e6
# ``repr`` and ``floatToGoString`` agree. Decimals in it have their first digit at 10**-14 … 10**5.
_SMALLEST = 1e-13
_LARGEST = 1e6
_LOWEST_EXPONENT, _HIGHEST_EXPONENT = -14, 5
_MOST_DIGITS = 9  # every float32 reads back from 9 significant digits
_FIRST_TRY = 7  # most figures need 7 or 8 digits: start there, walk down or up

# Scaling by 10**s as one multiplication and one division, so that each product rounds once however s is signed:
# x * _UP[s] / _DOWN[s] is x * 10**s for s >= 0 and x / 10**-s for s < 0. Indexed by s + _OFFSET.
_OFFSET = 8
_POWERS = 10.0 ** np.arange(23)
_SHIFTS = np.arange(-_OFFSET, 23)
_UP = np.where(_SHIFTS >= 0, _POWERS[np.clip(_SHIFTS, 0, None)], 1.0)
_DOWN = np.where(_SHIFTS < 0, _POWERS[np.clip(-_SHIFTS, 0, None)], 1.0)
# Up to this shift figure * 10**s is exact in float64 (24 bits of mantissa times 5**s fit in 53 bits): a computed
# tie is a true tie there, which rint breaks to even as Dragon4 does.
_LAST_EXACT_SHIFT = 12

# Bits of a float64 below float32 precision; a float32 rounding boundary has exactly the top one set.
_BELOW_FLOAT32 = np.uint64((1 << 29) - 1)
_FLOAT32_BOUNDARY = np.uint64(1 << 28)
_FLOAT32_MANTISSA = np.uint32((1 << 23) - 1)


def _numpy_spelling(value: float) -> str:
    # numpy's shortest float32 decimal, as prometheus_client spells its float64: the reference for every value.
    return _go_float(float(str(np.float32(value))))


def _digits_and_shift(text: str) -> tuple[int, int]:
    """``c`` and ``s`` of a decimal ``c * 10**-s`` written in ``text``, ``c`` without trailing zeros."""
    _sign, digits, exponent = Decimal(text).normalize().as_tuple()
    return int("".join(map(str, digits))), -int(exponent)


# The shortest decimal of each power of two in range as (c, s), indexed by frexp exponent less the first one's.
_FIRST_POWER_OF_TWO = int(np.floor(np.log2(_SMALLEST)))
_POWER_OF_TWO_DECIMALS = np.array(
    [
        _digits_and_shift(str(np.float32(2.0**k)))
        for k in range(_FIRST_POWER_OF_TWO, int(np.ceil(np.log2(_LARGEST))) + 1)
    ],
    dtype=np.int64,
)


def _try_digits(
    magnitude: npt.NDArray[np.float64],
    float32s: npt.NDArray[np.float32],
    exponent: npt.NDArray[np.int64],
    digits: int,
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """For each figure: whether its nearest ``digits``-digit decimal reads back as it, that decimal's ``c`` (its
    shift is ``digits - 1 - exponent``), and whether the arithmetic was unsure."""
    shift = digits - 1 - exponent + _OFFSET
    up, down = _UP[shift], _DOWN[shift]
    scaled = magnitude * up / down
    candidate = np.rint(scaled)
    decimal = candidate * down / up
    reads_back = decimal.astype(np.float32) == float32s
    near_tie = np.abs(np.abs(scaled - candidate) - 0.5) < 1e-6
    exact = (shift >= _OFFSET) & (shift <= _LAST_EXACT_SHIFT + _OFFSET)
    on_boundary = (decimal.view(np.uint64) & _BELOW_FLOAT32) == _FLOAT32_BOUNDARY
    return reads_back, candidate, (near_tie & ~exact) | on_boundary


def _shortest_decimals(
    float32s: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Each figure's shortest float32 decimal of its magnitude as ``c * 10**-s``: (c, s, where it was found)."""
    magnitude32 = np.abs(float32s)
    magnitude = magnitude32.astype(np.float64)
    in_range = (magnitude >= _SMALLEST) & (magnitude < _LARGEST)  # False for NaN: numpy's path spells it
    power_of_two = (magnitude32.view(np.uint32) & _FLOAT32_MANTISSA) == 0
    digits = np.zeros(float32s.shape, dtype=np.int64)  # zero is 0 * 10**0
    shifts = np.zeros(float32s.shape, dtype=np.int64)
    found = magnitude == 0.0
    powers = np.flatnonzero(in_range & power_of_two)
    digits[powers], shifts[powers] = _POWER_OF_TWO_DECIMALS[np.frexp(magnitude[powers])[1] - 1 - _FIRST_POWER_OF_TWO].T
    found[powers] = True
    todo = np.flatnonzero(in_range & ~power_of_two)
    exponent = np.floor(np.log10(magnitude[todo])).astype(np.int64)
    unsure = np.zeros(todo.size, dtype=np.bool_)
    # Walk down from the first try while shorter decimals still read back, up from it until one does.
    reads_back, candidate, doubt = _try_digits(magnitude[todo], magnitude32[todo], exponent, _FIRST_TRY)
    unsure |= doubt
    done = todo[reads_back]
    digits[done], shifts[done], found[done] = candidate[reads_back], _FIRST_TRY - 1 - exponent[reads_back], True
    for step, walking in ((-1, reads_back), (1, ~reads_back)):
        at = np.flatnonzero(walking)
        tries = _FIRST_TRY + step
        while at.size and 1 <= tries <= _MOST_DIGITS:
            reads_back, candidate, doubt = _try_digits(magnitude[todo[at]], magnitude32[todo[at]], exponent[at], tries)
            unsure[at] |= doubt
            done = todo[at[reads_back]]
            digits[done], shifts[done], found[done] = candidate[reads_back], tries - 1 - exponent[at[reads_back]], True
            at = at[reads_back] if step < 0 else at[~reads_back]
            tries += step
    found[todo[unsure]] = False
    # A candidate that rounded up to a power of ten (9.99…e-3 → 10e-3) ends in zeros: the text has none.
    zeros = np.flatnonzero(found & (digits % 10 == 0) & (digits > 0))
    while zeros.size:
        digits[zeros] //= 10
        shifts[zeros] -= 1
        zeros = zeros[digits[zeros] % 10 == 0]
    return digits, shifts, found


# The layout tables. A text's characters come from one source row of 28 bytes, written as seven 4-byte words so that
# filling it is three gathers of 4-digit groups and one broadcast: the decimal's nine digits zero-padded in columns
# 3-11 (columns 0-2 are the leading zeros of the first group, never read), then the constant characters, the last
# one NUL (numpy drops trailing NULs of a bytes value). The text is then one flat gather through the row's layout.
_GROUP_DIGITS = 4
_DIGITS_END = 3 * _GROUP_DIGITS  # the digits end where the constants start
_CONSTANTS = b"0123456789.-e\n\0\0"  # padded to a whole word
_ROW_WORDS = 3 + len(_CONSTANTS) // 4
_ROW_BYTES = 4 * _ROW_WORDS
_NUL_COLUMN = _DIGITS_END + _CONSTANTS.index(b"\0")
_TEXT_WIDTH = 16  # '-1.23456789e-13' or '-0.000123456789', and the newline
_EXPONENTS = _HIGHEST_EXPONENT - _LOWEST_EXPONENT + 1


def _layout(negative: bool, exponent: int, count: int) -> list[int]:
    """Source column of each character of the line ending that ``repr`` writes for a decimal of this shape."""
    digits = "123456789"[:count]
    text = repr(float(f"{'-' if negative else ''}{digits}e{exponent - count + 1}")) + "\n"
    mantissa_end = text.find("e") if "e" in text else len(text)
    columns = [
        _DIGITS_END - count + int(char) - 1
        if i < mantissa_end and char in digits
        else _DIGITS_END + _CONSTANTS.index(char.encode())
        for i, char in enumerate(text)
    ]
    return columns + [_NUL_COLUMN] * (_TEXT_WIDTH - len(columns))


# One row per shape, indexed by (negative * digit counts + digit count - 1) * exponents + exponent - lowest.
_LAYOUTS = np.array(
    [
        _layout(negative, exponent, count)
        for negative in (False, True)
        for count in range(1, _MOST_DIGITS + 1)
        for exponent in range(_LOWEST_EXPONENT, _HIGHEST_EXPONENT + 1)
    ],
    dtype=np.intp,
)
# The text of 0000 … 9999 as one 4-byte word each, and the constant characters as words.
_FOUR_DIGITS = np.array([list(f"{i:04d}".encode()) for i in range(10**_GROUP_DIGITS)], dtype=np.uint8).view(np.uint32)[
    :, 0
]
_CONSTANT_WORDS = np.frombuffer(_CONSTANTS, dtype=np.uint32)
_DIGIT_LIMITS = 10 ** np.arange(1, _MOST_DIGITS + 1, dtype=np.int64)


def _spell(
    negative: npt.NDArray[np.bool_], digits: npt.NDArray[np.int64], shifts: npt.NDArray[np.int64]
) -> list[bytes]:
    """``repr`` of each decimal ``±digits * 10**-shifts`` followed by a newline, laid out by table."""
    count = np.searchsorted(_DIGIT_LIMITS, digits, side="right") + 1  # zero has one digit
    shape = (negative * _MOST_DIGITS + count - 1) * _EXPONENTS + (count - 1 - shifts - _LOWEST_EXPONENT)
    source = np.empty((digits.size, _ROW_WORDS), dtype=np.uint32)
    source[:, 0] = _FOUR_DIGITS[digits // 10 ** (2 * _GROUP_DIGITS)]
    source[:, 1] = _FOUR_DIGITS[digits // 10**_GROUP_DIGITS % 10**_GROUP_DIGITS]
    source[:, 2] = _FOUR_DIGITS[digits % 10**_GROUP_DIGITS]
    source[:, 3:] = _CONSTANT_WORDS
    columns = np.take(_LAYOUTS, shape, axis=0)
    columns += np.arange(0, digits.size * _ROW_BYTES, _ROW_BYTES, dtype=np.intp)[:, None]
    text = np.take(source.view(np.uint8).ravel(), columns)
    return cast("list[bytes]", text.view(f"S{_TEXT_WIDTH}").ravel().tolist())


def float32_value_lines(values: npt.NDArray[np.floating[Any]]) -> list[bytes]:
    """The text-format spelling of each value rounded to float32, followed by a newline: ``floatToGoString`` of the
    float64 of its shortest float32 decimal (``0.1``, ``-0.0``, ``1.5e-05``, ``1.0e+06``, ``NaN``, ``+Inf``)."""
    with np.errstate(invalid="ignore"):  # a signalling NaN warns when cast; it is spelled NaN all the same
        float32s = np.asarray(values).astype(np.float32)
        digits, shifts, found = _shortest_decimals(float32s)
    lines = _spell(np.signbit(float32s), np.where(found, digits, 0), np.where(found, shifts, 0))
    for i in np.flatnonzero(~found).tolist():
        lines[i] = (_numpy_spelling(float(float32s[i])) + "\n").encode()
    return lines
