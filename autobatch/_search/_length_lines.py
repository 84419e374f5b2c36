"""Memory across lengths: the line of a length not measured yet, from the lines of those measured.

At one sequence length a step's peak is affine in the batch size (``fixed + per_sample * n``,
a :class:`LinearModel`). Across lengths, every operator's part grows as a polynomial in the
length: most activations linearly, attention scores quadratically, a few per-sample outputs
(the pooled features, the logits, the labels) not at all. So ``per_sample`` is a polynomial of
degree at most 2 in the length, and ``fixed`` (weights, gradients, optimizer state, a mask or a
workspace that grows with the length) nearly constant. :func:`predict_line` fits both through
the lines measured nearest the length asked; the search then proves the size it predicts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from autobatch._search._model import LinearModel
from autobatch._validate import check_int


def predict_line(lines: Mapping[int, LinearModel], length: int) -> LinearModel | None:
    """The memory line at ``length``, from the lines measured at other lengths.

    ``per_sample`` follows the measured lines: with one, in proportion to the length; with
    two or more, as ``b*L + c*L**2`` (exact for parts linear and quadratic in the length,
    such as a transformer's activations and attention scores), through both, or the
    least-squares fit of the bytes per token through all of them (each measured size is a
    whole number of samples, so each line's slope is off by up to a sample's rounding; the
    fit averages that out, where a curve through the nearest points would extrapolate it).
    When that does not grow with the length between the measured neighbours of ``length``,
    it falls back to the proportion to the nearest. ``fixed`` is the nearest line's
    with one line, else on the straight line through the two nearest. ``None`` when no
    positive line comes out.

    >>> lines = {128: LinearModel(2e6, 128 * 13_344 + 96 * 128**2),
    ...          96: LinearModel(2e6, 96 * 13_344 + 96 * 96**2)}
    >>> predict_line(lines, 64).per_sample == 64 * 13_344 + 96 * 64**2
    True

    Args:
        lines: the measured lines, by length.
        length: the length to predict (not necessarily between the measured ones).
    """
    check_int("length", length)
    if not lines:
        raise ValueError("predict_line needs at least one measured line")
    for measured in lines:
        check_int("a measured length", measured)
    if length in lines:
        return lines[length]
    nearest = sorted(lines, key=lambda m: (abs(m - length), -m))
    per_sample = _per_sample(lines, nearest, length)
    fixed = _fixed(lines, nearest, length)
    if not (math.isfinite(per_sample) and per_sample > 0 and math.isfinite(fixed)):
        return None
    return LinearModel(fixed, per_sample)


def _per_sample(lines: Mapping[int, LinearModel], nearest: Sequence[int], length: int) -> float:
    """Through the two nearest lines if that grows with the length between the measured
    neighbours of ``length``, else in proportion to the nearest."""
    known = {m: lines[m].per_sample for m in nearest}
    below = max((m for m in known if m < length), default=None)
    above = min((m for m in known if m > length), default=None)

    def plausible(value: float) -> bool:
        if not (math.isfinite(value) and value > 0):
            return False
        if below is not None and value < known[below]:
            return False
        return above is None or value <= known[above]

    if len(nearest) >= 2:
        value = _through_origin(nearest, known, length)
        if plausible(value):
            return value
    closest = nearest[0]
    return known[closest] * length / closest


def _through_origin(points: Sequence[int], known: Mapping[int, float], length: int) -> float:
    """``b*L + c*L**2`` through the ``points``' ``(length, per_sample)``, at ``length``: per
    token, the least-squares straight line (through both points when there are two)."""
    count = len(points)
    x_mean = sum(points) / count
    ratios = [known[x] / x for x in points]
    r_mean = sum(ratios) / count
    spread = sum((x - x_mean) ** 2 for x in points)
    slope = sum((x - x_mean) * (r - r_mean) for x, r in zip(points, ratios, strict=True)) / spread
    return length * (r_mean + slope * (length - x_mean))


def _fixed(lines: Mapping[int, LinearModel], nearest: Sequence[int], length: int) -> float:
    if len(nearest) == 1:
        return lines[nearest[0]].fixed
    x_1, x_2 = nearest[:2]
    y_1, y_2 = lines[x_1].fixed, lines[x_2].fixed
    return y_1 + (y_2 - y_1) * (length - x_1) / (x_2 - x_1)
