"""The `countdown` task: reach a target from given numbers with + - * (each number once).

A task with many right answers (issue #17): `3 5 7>22` is solved by 3*5+7, 7+3*5, 5*3+7,
7+5*3, ..., so correct responses of a group differ and so do their learner-to-reference log
ratios, the paper's regime (seed Figure 9), unlike digit sorting's one correct string.

Problems (`make`): difficulty d draws n = min(2 + d, 5) numbers uniformly from 1..9 and a
random expression over all of them (a random order, a random binary tree, each operator
uniform in + - *); its value is the target, redrawn until it is at least 1. The problem
text is `3 5 7>22` (numbers in drawn order; the tiny model's prompt `Q:3 5 7>22\\nA:`),
the reference answer `countdown:3 5 7=22`, and the drawn expression, printed with the
fewest parentheses, is a correct response (the warm-up's target: a random solution per
problem, so the warm-up teaches variety). `solutions` enumerates every correct expression
(distinct strings, fewest parentheses), for counting.

Grading (`grade(response, reference) -> (reward, status)`, routed here by the reference's
`countdown:` prefix, pipeline/tasks/grading.py): the meaning of the last `\\boxed{...}` is
checked, not its spelling.
- `no_answer`: no `\\boxed`. `parse_error`: a box that is never closed or empty, longer
  than MAX_CHARS, nested deeper than MAX_DEPTH, or with a character outside ASCII digits,
  `+ - * / ^ ( )`, whitespace and the signs `−` (U+2212) and `×` (read as - and *).
  Non-ASCII digits (`٣`, fullwidth `３`) are such characters: parse_error, never read as
  numbers. `**` is one operator (a power).
- `ok` with reward 0: a well-formed expression that breaks the rules: division or a power,
  a unary sign, a number that is not given or used more often than given, a given number
  left out; or one that follows them and misses the target. Such an expression is never
  evaluated, so division by zero and power towers cannot happen; the only expressions
  evaluated use + - * over the given numbers, whose values stay small.
- `ok` with reward 1: exactly the given numbers, each as often as given, + - * and
  parentheses, and the value is the target. Whitespace between tokens is ignored and
  leading zeros are allowed (`07` uses the 7).
The cost is linear in the response (one scan for the box) plus a parse of at most
MAX_CHARS characters; the grading worker's CPU-time limit still applies.
"""
from __future__ import annotations

import itertools
from collections import Counter
from functools import lru_cache

from pipeline.core.errors import ParseError

PREFIX = "countdown:"
MAX_CHARS = 200        # a box longer than this is no answer of this task (the longest solution is ~20)
MAX_DEPTH = 16         # parentheses nesting
MAX_DIGITS = 9         # a longer number cannot be a given one: it is never converted
OPS = "+-*"
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "^": 3}
_SIGNS = {"−": "-", "×": "*"}


# ---------------------------------------------------------------- problems

def join(op: str, a: str, pa: int, b: str, pb: int) -> str:
    """`a op b` with the parentheses its operands of precedence pa, pb need (a - (b - c))."""
    if pa < _PREC[op]:
        a = f"({a})"
    if pb < _PREC[op] or (pb == _PREC[op] and op == "-"):
        b = f"({b})"
    return f"{a}{op}{b}"


def render(tree) -> tuple[str, int]:
    """(text with the fewest parentheses, precedence) of a tree: an int or (op, left, right)."""
    if isinstance(tree, int):
        return str(tree), 9
    op, left, right = tree
    (a, pa), (b, pb) = render(left), render(right)
    return join(op, a, pa, b, pb), _PREC[op]


def value(tree) -> int:
    """The value of a tree of + - * only (anything else was refused before: KeyError)."""
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    a, b = value(left), value(right)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def random_tree(numbers: list[int], rng):
    """A random expression over `numbers` in this order: a random split, a random operator."""
    if len(numbers) == 1:
        return numbers[0]
    cut = rng.randint(1, len(numbers) - 1)
    return rng.choice(OPS), random_tree(numbers[:cut], rng), random_tree(numbers[cut:], rng)


def count_of(difficulty: int) -> int:
    return min(2 + difficulty, 5)


def make(difficulty: int, rng) -> tuple[str, str, str]:
    """(problem, reference answer, one correct expression) from the random stream `rng`."""
    numbers = [rng.randint(1, 9) for _ in range(count_of(difficulty))]
    while True:
        order = numbers[:]
        rng.shuffle(order)
        tree = random_tree(order, rng)
        target = value(tree)
        if target >= 1:
            shown = " ".join(map(str, numbers))
            return f"{shown}>{target}", f"{PREFIX}{shown}={target}", render(tree)[0]


@lru_cache(maxsize=4096)
def _trees(numbers: tuple[int, ...]) -> tuple[tuple[str, int, int], ...]:
    """(text, precedence, value) of every tree over `numbers` in this order."""
    if len(numbers) == 1:
        return ((str(numbers[0]), 9, numbers[0]),)
    out = []
    for cut in range(1, len(numbers)):
        for (a, pa, va), (b, pb, vb) in itertools.product(_trees(numbers[:cut]), _trees(numbers[cut:])):
            for op in OPS:
                out.append((join(op, a, pa, b, pb), _PREC[op], value((op, va, vb))))
    return tuple(out)


def solutions(numbers: tuple[int, ...], target: int) -> set[str]:
    """Every correct expression as distinct text (fewest parentheses), all orders and trees."""
    return {text for order in set(itertools.permutations(numbers)) for text, _, v in _trees(order) if v == target}


def parse_reference(reference: str) -> tuple[tuple[int, ...], int]:
    """`countdown:3 5 7=22` -> ((3, 5, 7), 22)."""
    numbers, _, target = reference.removeprefix(PREFIX).partition("=")
    return tuple(int(x) for x in numbers.split()), int(target)


# ---------------------------------------------------------------- the verifier

def last_box(response: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces matched); None without `\\boxed`.
    Raises ParseError for a box that is never closed."""
    start = response.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    if response[i:i + 1] != "{":
        raise ParseError("\\boxed without {")
    depth = 0
    for j in range(i, min(len(response), i + MAX_CHARS + 2)):
        depth += {"{": 1, "}": -1}.get(response[j], 0)
        if depth == 0:
            return response[i + 1:j]
    raise ParseError("box never closed within MAX_CHARS")


def tokens(text: str) -> list[str]:
    """Numbers (ASCII digit runs) and operator/paren characters; whitespace dropped."""
    out, i = [], 0
    while i < len(text):
        ch = _SIGNS.get(text[i], text[i])
        if "0" <= ch <= "9":
            j = i
            while j < len(text) and "0" <= text[j] <= "9":
                j += 1
            out.append(text[i:j])
            i = j
            continue
        if ch == "*" and text[i + 1:i + 2] == "*":
            ch, i = "^", i + 1       # ** is a power, not two products
        if ch in "+-*/^()":
            out.append(ch)
        elif not ch.isspace():
            raise ParseError(f"character {ch!r}")
        i += 1
    return out


class _Parser:
    """Recursive descent: expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := unary ('^' factor)?; unary := ('+'|'-')* atom; atom := number | '(' expr ')'.
    Builds trees of ints and (op, left, right); records rule breaks instead of evaluating."""

    def __init__(self, toks: list[str]):
        self.toks, self.i, self.depth = toks, 0, 0
        self.numbers: list[str] = []
        self.broken = False       # division, power or a unary sign

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ParseError("expression ends early")
        self.i += 1
        return tok

    def expr(self):
        tree = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            tree = (op, tree, self.term())
        return tree

    def term(self):
        tree = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            self.broken |= op == "/"
            tree = (op, tree, self.factor())
        return tree

    def factor(self):
        tree = self.unary()
        if self.peek() == "^":
            self.take()
            self.broken = True
            tree = ("^", tree, self.factor())
        return tree

    def unary(self):
        while self.peek() in ("+", "-"):
            self.take()
            self.broken = True
        return self.atom()

    def atom(self):
        tok = self.take()
        if tok == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ParseError("nested too deep")
            tree = self.expr()
            if self.take() != ")":
                raise ParseError("unbalanced parentheses")
            self.depth -= 1
            return tree
        if not tok[0].isdigit():
            raise ParseError(f"unexpected {tok!r}")
        self.numbers.append(tok)
        return int(tok) if len(tok) <= MAX_DIGITS else None


def grade(response: str, reference: str) -> tuple[float, str]:
    """(reward, status) of a response to the problem whose reference is `reference`."""
    numbers, target = parse_reference(reference)
    try:
        box = last_box(response)
        if box is None:
            return 0.0, "no_answer"
        if len(box) > MAX_CHARS or not box.strip():
            return 0.0, "parse_error"
        parser = _Parser(tokens(box))
        tree = parser.expr()
        if parser.peek() is not None:
            raise ParseError(f"unexpected {parser.peek()!r}")
    except ParseError:
        return 0.0, "parse_error"
    used = Counter(int(n) if len(n) <= MAX_DIGITS else -1 for n in parser.numbers)
    if parser.broken or used != Counter(numbers):
        return 0.0, "ok"
    return float(value(tree) == target), "ok"
