"""The `countdown_work:W` task: countdown whose responses write their search (issue #34, the
length axis).

The problems, prompts, reference answers and verifier are countdown's (pipeline/tasks/countdown.py):
the same `Q:3 5 7>22\\nA:` prompt, the same `countdown:3 5 7=22` reference, graded on the last
`\\boxed{}` only, with countdown's bounds. At the same difficulty and split seed the train and
eval splits are countdown's own problems (catalog.stream_name), so the tasks differ only in
what a response writes. What changes is the warm-up's target, a search trace, so that the
base writes its work before it answers:

    3+5=8
    8*7=56
    8+7=15
    5*3=15
    15+7=22
    \\boxed{5*3+7}

The trace (`trace(numbers, target, w, rng)`) is a depth-first search over the ways to combine
two of the remaining numbers (+, *, and the larger minus the smaller) until one is left, in
an order drawn from `rng`. Every combination it takes is a line `a op b=v`; a line is written
once, where the search first passes it, and its descendants follow it (shared prefixes are
not repeated). A leaf whose value is not the target is a failed try. The trace writes the
first W failed tries the search meets, skipping a leaf that hits the target until it has
(so a line that hits the target is always followed by its box), then goes on to the first
leaf that hits it and boxes that leaf's expression (fewest parentheses). When the search
holds fewer than W failed tries it writes them all; when the larger-minus-smaller search
holds no solution (never at level 1: each of the 1,973 pairs of 3 numbers and a reachable
target >= 1 has one) it searches again with both orders of `-`, which reaches every + - *
expression, so a trace exists for every problem `countdown.make` draws.
W sets the length: at level 1 (3 numbers) each failed try adds ~9.5 tokens (characters);
`measure_lengths` gives the table (mean characters of the trace, without the end token):

    W      0     4     8    10    12
    mean  27    67   103   122   141

A response may be as long as `budget(w, count)` tokens: W failed tries and the solution's
path with room (the longest of 500 level-1 traces: 31 tokens at W = 0, 142 at W = 10, against
budgets of 38 and 158). The base stage's check samples use it (catalog.response_budget), and
the presets set rollout/eval.max_new_tokens to it (pipeline/presets/tiny-regime-long*.toml).
"""
from __future__ import annotations

import itertools
import random
from typing import Iterator

from pipeline.tasks import countdown

NAME = "countdown_work"
MAX_WIDTH = 64          # W above this writes every failed try of the search at level 1 anyway

Item = tuple[int, str, int]           # (value, expression text, precedence)
Step = tuple[tuple, str]              # (the node's identity: its path of choices, its line)


def parse_name(name: str) -> int | None:
    """W of `countdown_work:W` (`countdown_work` alone is W = 0); None for another name.
    A malformed W raises ValueError naming the form."""
    base, sep, width = name.partition(":")
    if base != NAME:
        return None
    if not sep:
        return 0
    if not width.isdigit() or int(width) > MAX_WIDTH:
        raise ValueError(f"task.name '{name}': W in '{NAME}:W' must be an integer 0..{MAX_WIDTH}")
    return int(width)


def combine(a: Item, b: Item, op: str) -> tuple[str, Item]:
    """(the line `a op b=v`, the combined item) of a then b."""
    v = {"+": a[0] + b[0], "-": a[0] - b[0], "*": a[0] * b[0]}[op]
    return f"{a[0]}{op}{b[0]}={v}", (v, countdown.join(op, a[1], a[2], b[1], b[2]), countdown._PREC[op])


def moves(items: list[Item], rng: random.Random, signed: bool) -> list[tuple[str, list[Item]]]:
    """Every (line, remaining items) one combination of two items makes, in a drawn order:
    + and * once per pair, - as larger minus smaller (both orders when `signed`)."""
    out = []
    for i, j in itertools.combinations(range(len(items)), 2):
        a, b = items[i], items[j]
        rest = [x for k, x in enumerate(items) if k not in (i, j)]
        pairs = [(a, b, "+"), (a, b, "*")]
        pairs += [(a, b, "-"), (b, a, "-")] if signed else [(max(a, b), min(a, b), "-")]
        for x, y, op in pairs:
            line, item = combine(x, y, op)
            out.append((line, rest + [item]))
    rng.shuffle(out)
    return out


def leaves(items: list[Item], rng: random.Random, signed: bool,
           path: tuple[Step, ...] = ()) -> Iterator[tuple[tuple[Step, ...], Item]]:
    """(path of steps, the last item) of every leaf, depth first, lazily (the search stops
    when the trace is written: 5 numbers hold ~10^5 leaves)."""
    if len(items) == 1:
        yield path, items[0]
        return
    for k, (line, rest) in enumerate(moves(items, rng, signed)):
        node = (path[-1][0] if path else ()) + (k,)
        yield from leaves(rest, rng, signed, path + ((node, line),))


def pick(numbers: tuple[int, ...], target: int, w: int, rng: random.Random,
         signed: bool) -> list[tuple[tuple[Step, ...], Item]] | None:
    """The leaves a trace writes, in order: up to w failed tries, then one that hits the
    target (None when the search holds none)."""
    start = [(n, str(n), 9) for n in numbers]
    written: list[tuple[tuple[Step, ...], Item]] = []
    first_hit = None
    for path, item in leaves(start, rng, signed):
        if item[0] != target:
            if len(written) < w:
                written.append((path, item))
            continue
        first_hit = first_hit or (path, item)
        if len(written) >= w:
            return written + [(path, item)]
    return written + [first_hit] if first_hit else None


def trace(numbers: tuple[int, ...], target: int, w: int, rng: random.Random) -> str:
    """The response a search of width w writes: its lines, then `\\boxed{expr}` (module doc)."""
    chosen = pick(numbers, target, w, rng, signed=False) or pick(numbers, target, w, rng, signed=True)
    if chosen is None:      # cannot happen for a target countdown.make drew from these numbers
        raise ValueError(f"no + - * expression of {numbers} reaches {target}")
    lines: list[str] = []
    shown: set[tuple] = set()
    for path, _ in chosen:
        for node, line in path:
            if node not in shown:
                shown.add(node)
                lines.append(line)
    return "\n".join(lines + [f"\\boxed{{{chosen[-1][1][1]}}}"])


def budget(w: int, count: int = 3) -> int:
    """Tokens a response may take: W failed tries and the solution's count - 1 lines, each
    `a op b=v` and its newline (2 * count + 4 characters bounds a line at 3 to 5 numbers),
    the box, and a fifth more (the longest of 500 traces at level 1: 31 tokens at W = 0,
    142 at W = 10, against budgets of 38 and 158)."""
    return int(1.2 * (12 + (w + count - 1) * (2 * count + 4)))


def measure_lengths(widths: list[int], problems: int = 2000, difficulty: int = 1, seed: int = 0) -> dict[int, float]:
    """Mean trace length (characters, which the tiny model's tokens are) per width over
    `problems` drawn problems: the table of the module doc."""
    out = {}
    for w in widths:
        rng, trng = random.Random(seed), random.Random(seed + 1)
        total = 0
        for _ in range(problems):
            problem, reference, _ = countdown.make(difficulty, rng)
            total += len(trace(*countdown.parse_reference(reference), w, trng))
        out[w] = total / problems
    return out
