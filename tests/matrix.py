"""A deterministic pairwise (strength-2 covering array) generator for test matrices.

An *axis* is a name and a list of values; a *row* picks one value index per axis. A
row set covers a pair ``((a, i), (b, j))`` of two axes ``a != b`` when some row picks
value ``i`` of ``a`` and value ``j`` of ``b``. :func:`pairwise` returns rows that cover
every allowed pair, :func:`uncovered_pairs` lists the allowed pairs a row set misses
(the generator's own check, and a test's).

Pure functions, no randomness: the same axes give the same rows on every machine, so a
failing row of a CI run is the same row on a developer's machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import combinations

#: A pair of (axis name, value index), the axis names in the axes' order.
Pair = tuple[tuple[str, int], tuple[str, int]]
#: One row: axis name -> value index.
Row = dict[str, int]


def all_pairs(sizes: Mapping[str, int], allowed: Callable[[Pair], bool] | None = None) -> list[Pair]:
    """Every pair of values of two axes, in the axes' order, that ``allowed`` accepts.

    Args:
        sizes: axis name -> number of values (>= 1), in a fixed order.
        allowed: False for a pair no row may hold (a combination the config refuses);
            None: every pair is allowed.
    """
    names = list(sizes)
    out = []
    for a, b in combinations(names, 2):
        for i in range(sizes[a]):
            for j in range(sizes[b]):
                p = ((a, i), (b, j))
                if allowed is None or allowed(p):
                    out.append(p)
    return out


def _row_pairs(row: Row, names: Sequence[str]) -> set[Pair]:
    present = [n for n in names if n in row]
    return {((a, row[a]), (b, row[b])) for a, b in combinations(present, 2)}


def uncovered_pairs(
    sizes: Mapping[str, int], rows: Sequence[Row], allowed: Callable[[Pair], bool] | None = None
) -> list[Pair]:
    """The allowed pairs of ``sizes`` that no row of ``rows`` holds (empty: covered)."""
    names = list(sizes)
    seen: set[Pair] = set()
    for r in rows:
        seen |= _row_pairs(r, names)
    return [p for p in all_pairs(sizes, allowed) if p not in seen]


def pairwise(sizes: Mapping[str, int], allowed: Callable[[Pair], bool] | None = None) -> list[Row]:
    """Rows (axis name -> value index) covering every allowed pair of values of two axes.

    Greedy and deterministic: each new row is the best of one candidate per uncovered
    pair (the one covering the most uncovered pairs; the first on a tie). A candidate
    starts from its pair, then fills the other axes (most values first) with the value
    that covers the most uncovered pairs together with the values already chosen, the
    lowest index on a tie, never a value that forms a pair ``allowed`` refuses.

    Args:
        sizes: axis name -> number of values (>= 1), in a fixed order.
        allowed: as in :func:`all_pairs`.
    Returns:
        the rows, each naming every axis.
    Raises:
        ValueError: an axis without values, or an axis no allowed value fits into a row
            (constraints that leave some started row without a completion).
    """
    names = list(sizes)
    for n in names:
        if sizes[n] < 1:
            raise ValueError(f"axis {n!r}: needs at least one value, got {sizes[n]}")
    order = {n: k for k, n in enumerate(names)}

    def pair(a: str, i: int, b: str, j: int) -> Pair:
        return ((a, i), (b, j)) if order[a] < order[b] else ((b, j), (a, i))

    def ok(p: Pair) -> bool:
        return allowed is None or allowed(p)

    def complete(seed: Pair, todo: set[Pair]) -> Row:
        (a, i), (b, j) = seed
        row: Row = {a: i, b: j}
        for n in fill_order:
            if n in row:
                continue
            best, best_gain = None, -1
            for v in range(sizes[n]):
                ps = [pair(n, v, m, row[m]) for m in row]
                if not all(ok(p) for p in ps):
                    continue
                gain = sum(p in todo for p in ps)
                if gain > best_gain:
                    best, best_gain = v, gain
            if best is None:
                raise ValueError(f"axis {n!r}: no value fits the row {row} under the constraints")
            row[n] = best
        return {n: row[n] for n in names}

    todo = set(all_pairs(sizes, allowed))
    rows: list[Row] = []
    fill_order = sorted(names, key=lambda n: (-sizes[n], order[n]))
    while todo:
        best_row, best_gain = None, -1
        for seed in sorted(todo, key=lambda p: (order[p[0][0]], p[0][1], order[p[1][0]], p[1][1])):
            row = complete(seed, todo)
            gain = len(_row_pairs(row, names) & todo)
            if gain > best_gain:
                best_row, best_gain = row, gain
        todo -= _row_pairs(best_row, names)
        rows.append(best_row)
    return rows
