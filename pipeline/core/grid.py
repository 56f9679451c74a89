"""Experiments as a grid: seeds × methods × config fields, each cell a validated config.

`cells(cfg)` expands `experiment.seeds` × `experiment.methods` × the product of
`experiment.grid` (`{"train.lr": [1e-5, 1e-4], "train.t_ref": ["fixed", 8]}`) into cells,
seed outermost, then methods, then the grid fields in their declared order (the last
field varies fastest). A methods entry is a method name (`{"train.method": name}`) or a
name in `experiment.variants` (its dotted overrides, e.g. `{"train.method": "ggpo",
"train.ggpo_clip_delta": 0.05}`; without `train.method` the base config's method applies);
`["all"]` is every registered method, plugins included (config.expand_all: the config holds
the expanded list, so cells never see "all").
Overrides apply as base config <- method / variant <- grid values <- seed.

Every cell's config is validated as the config it trains: an invalid one raises
`ConfigError` naming the cell, so a flow that calls `cells` first fails before any work.
Pure: no I/O, no stage imports; the offline flow uses it, and so can an online one. With no
grid and no variants a cell's config is exactly `cfg.updated({"seed": s, "train.method": m})`,
the config the comparison always trained, and its label is the method name.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pipeline.core.config import ConfigError, PipelineConfig


@dataclass(frozen=True, eq=False)
class GridCell:
    seed: int
    method: str                   # the methods entry: a method or a variant name
    values: dict[str, Any]        # grid field (dotted) -> this cell's value, in grid order
    label: str                    # "ggpo t_ref=8 lr=1e-4": method and grid values, no seed
    overrides: dict[str, Any]     # every dotted override applied to the base config
    config: PipelineConfig        # validated: what this cell trains and evaluates

    @property
    def slug(self) -> str:
        """The label as a run / metric name (MLflow takes no '=' or ' '): ggpo-t_ref:8-lr:1e-4."""
        return slug(self.label)

    def tag(self, fields: set[str] | None = None) -> str:
        """'-t_ref:8-lr:1e-4' for the grid values in `fields` (all when None): stage run names."""
        parts = [f"{short_names(self.values)[f]}={fmt(v)}" for f, v in self.values.items()
                 if fields is None or f in fields]
        return "".join("-" + slug(p) for p in parts)


def cells(cfg: PipelineConfig) -> list[GridCell]:
    """Every (seed, method, grid point) of `cfg.experiment`, validated; see the module doc."""
    exp = cfg.experiment
    fields = list(exp.grid)
    out = []
    for method in exp.methods:
        for point in itertools.product(*(exp.grid[f] for f in fields)):
            values = dict(zip(fields, point))
            label = " ".join([method] + [f"{short_names(values)[f]}={fmt(v)}" for f, v in values.items()])
            overrides = method_overrides(cfg, method) | values
            config = validated(cfg, overrides, label)
            out += [GridCell(seed, method, values, label, overrides | {"seed": seed}, config.updated({"seed": seed}))
                    for seed in exp.seeds]
    return sorted(out, key=lambda c: exp.seeds.index(c.seed))    # stable: methods, grid order kept


def method_overrides(cfg: PipelineConfig, method: str) -> dict[str, Any]:
    """A variant's overrides, or {"train.method": method} for a plain method name."""
    variants = cfg.experiment.variants
    return dict(variants[method]) if method in variants else {"train.method": method}


def validated(cfg: PipelineConfig, overrides: dict[str, Any], label: str) -> PipelineConfig:
    try:
        return cfg.updated(overrides)
    except (ValidationError, ConfigError) as exc:
        detail = "\n".join(f"  {'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()) \
            if isinstance(exc, ValidationError) else f"  {exc}"
        raise ConfigError(f"experiment cell '{label}' is not a valid config ({overrides}):\n{detail}\n"
                          f"fix experiment.methods / experiment.variants / experiment.grid, "
                          f"or the base config it starts from") from None


def columns(cell: GridCell, cfg: PipelineConfig) -> dict[str, Any]:
    """Report columns of a cell: {"cell": label, field: value, ...}; {} without a grid, so
    the default report keeps its columns. A field whose values mix types (t_ref "fixed", 8)
    is reported as text, a numeric one as numbers."""
    if not cfg.experiment.grid:
        return {}
    out: dict[str, Any] = {"cell": cell.label}
    for field, value in cell.values.items():
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in cfg.experiment.grid[field])
        out[field] = value if numeric else fmt(value)
    return out


def short_names(values: dict[str, Any]) -> dict[str, str]:
    """Dotted field -> its last part ("train.lr" -> "lr"), the full name where two clash."""
    leaves = [f.rsplit(".", 1)[-1] for f in values]
    return {f: leaf if leaves.count(leaf) == 1 else f for f, leaf in zip(values, leaves)}


def fmt(value: Any) -> str:
    """Short, exact text of a grid value: 1e-4 (not 0.0001), 0.05, 8, fixed."""
    if isinstance(value, float):
        plain = f"{value:g}"
        mantissa, exp = f"{value:e}".split("e")
        sci = f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
        exact = [s for s in (plain, sci) if float(s) == value]
        return min(exact, key=len) if exact else repr(value)
    return str(value)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:-]", "-", text.replace("=", ":"))
