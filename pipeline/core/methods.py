"""One record per training method: what config, preflight, the pool checks and the trainer
need to know about it, in one torch-free table.

A method is a loss function (`pipeline/training/losses.py`, signature `fn(inputs, cfg) ->
(loss, metrics)`) plus one `Method` entry here. Everything else reads the entry:

- config: `train.method` must name an entry; `train.beta > 0` when `needs_beta`; the
  default `train.t_ref` is `default_t_ref`; `train.ggpo_clip_delta` only where `clip_delta`;
  `train.aggregation` other than token-mean only where `honors_aggregation`; a correction
  option (config.CORRECTION_OPTIONS) away from its default only where `options` names it;
- preflight and the train stage: a pool without behavior log-probs, or `rollout.top_p < 1`,
  is refused for a method that needs them (`needs_lp_beh`, or `uses_anchor` with
  `train.anchor=behavior`), in one line naming the file, the column and the method;
- the trainer: the step anchor lp_old is computed at step starts when `needs_lp_old`, or
  `uses_anchor` with `train.anchor=old`, or the clip variant is on; the loss is `loss`.

Adding a method outside this repository: a module that calls `register_method(Method(...))`
at import, its loss function named by `loss="package.module:function"`, and the module's
name in the environment variable `GGPO_PLUGINS` (comma-separated), which every ggpo process
(CLI, flows, torchrun ranks, Ray workers: they inherit the environment) imports the first
time it looks a method up. docs/math.md has the losses; tests/test_methods.py trains a toy
method registered this way through `ggpo stage train`.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

PLUGINS_ENV = "GGPO_PLUGINS"


@dataclass(frozen=True)
class Method:
    name: str                      # the value of train.method
    title: str                     # how messages name it ("GRPO+TIS")
    loss: str                      # "module:function", the loss (imported by the trainer only)
    needs_lp_beh: bool = False     # always reads behavior log-probs (the pool's behavior_logprobs)
    needs_lp_old: bool = False     # always reads the step anchor lp_old (recomputed at step starts)
    uses_anchor: bool = False      # its ratio is anchored at train.anchor: lp_beh (behavior) or lp_old (old)
    clip_delta: bool = False       # accepts train.ggpo_clip_delta (then it reads lp_old)
    needs_beta: bool = False       # divides by train.beta: beta must be > 0
    default_t_ref: int | None = None   # train.t_ref="default": refresh every this many updates; None = fixed
    honors_aggregation: bool = False   # its loss aggregates by train.aggregation (else token-mean only)
    options: tuple[str, ...] = ()      # the train.* correction options it reads (config.CORRECTION_OPTIONS)

    def needs_behavior(self, anchor: str) -> bool:
        """Behavior log-probs under `train.anchor=anchor`."""
        return self.needs_lp_beh or (self.uses_anchor and anchor == "behavior")

    def needs_step_anchor(self, anchor: str, clip_delta: float | None) -> bool:
        """lp_old at step starts under `train.anchor` and `train.ggpo_clip_delta`."""
        return self.needs_lp_old or (self.uses_anchor and anchor == "old") or (self.clip_delta and clip_delta is not None)


LOSS_MODULE = "pipeline.training.losses"
CORRECTIONS_MODULE = "pipeline.training.corrections"


def _correction(name: str, title: str, old: bool, beh: bool, options: tuple[str, ...] = ()) -> Method:
    """An off-policy correction of the field (docs/math.md, "Off-policy corrections"): loss
    `<name>_loss` in pipeline/training/corrections.py; it reads lp_old (the step-start recompute)
    and/or lp_beh (behavior) as its source's default anchor does, and honors train.aggregation."""
    return Method(name, title, f"{CORRECTIONS_MODULE}:{name}_loss", needs_lp_beh=beh, needs_lp_old=old,
                  honors_aggregation=True, options=options)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("grpo", "GRPO", f"{LOSS_MODULE}:grpo_loss", uses_anchor=True, honors_aggregation=True),
    Method("grpo_tis", "GRPO+TIS", f"{LOSS_MODULE}:grpo_tis_loss", needs_lp_beh=True, needs_lp_old=True,
           honors_aggregation=True),
    Method("agro", "AGRO", f"{LOSS_MODULE}:agro_loss", needs_beta=True, default_t_ref=160),
    Method("ggpo", "GGPO", f"{LOSS_MODULE}:ggpo_loss", clip_delta=True, needs_beta=True, default_t_ref=160),
    _correction("tis_seq", "GRPO+seq-TIS", old=True, beh=True),
    _correction("icepop", "IcePop", old=True, beh=True, options=("is_threshold_low", "is_threshold_high")),
    _correction("geo_mask", "Geo-mask", old=True, beh=True, options=("geo_mask_low", "geo_mask_high")),
    _correction("opsm", "OPSM", old=True, beh=True, options=("opsm_delta",)),
    _correction("cispo", "CISPO", old=True, beh=False, options=("cispo_eps_clip_low", "cispo_eps_clip_high")),
    _correction("gspo", "GSPO", old=True, beh=False, options=("gspo_eps_low", "gspo_eps_high")),
    _correction("m2po", "M2PO", old=True, beh=True, options=("m2_threshold", "behave_imp_weight_cap")),
    _correction("dppo_tv", "DPPO-TV", old=False, beh=True, options=("dppo_mask_low", "dppo_mask_high", "dppo_kl_tau")),
    _correction("decoupled_ppo", "Decoupled PPO", old=True, beh=True, options=("behave_imp_weight_cap",)),
    _correction("topr", "TOPR", old=True, beh=False),
    _correction("plain_is", "Plain IS", old=False, beh=True),
    _correction("sapo", "SAPO", old=True, beh=False, options=("sapo_tau_pos", "sapo_tau_neg")),
    _correction("vespo", "VESPO", old=True, beh=True,
                options=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")),
    _correction("dppo_kl", "DPPO-KL", old=True, beh=False,
                options=("dppo_kl_delta_low", "dppo_kl_delta_high", "dppo_kl_clip_c")),
    _correction("gmpo", "GMPO", old=True, beh=False, options=("gmpo_eps_low", "gmpo_eps_high")),
    _correction("opmd", "OPMD", old=False, beh=False, options=("opmd_tau", "opmd_baseline")),
)}
BUILT_IN = tuple(METHODS)
_loaded: set[str] = set()


def register_method(method: Method) -> Method:
    """Add a method to the table (a plugin module calls this at import). Re-registering the
    same record is a no-op; another record under a taken name is refused."""
    if ":" not in method.loss:
        raise ValueError(f"method '{method.name}': loss must be 'module:function', got '{method.loss}'")
    known = METHODS.get(method.name)
    if known is not None and known != method:
        raise ValueError(f"method '{method.name}' is already registered ({known.loss})")
    METHODS[method.name] = method
    return method


def load_plugins() -> None:
    """Import the modules named in $GGPO_PLUGINS (once each); they register their methods."""
    for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
        if name not in _loaded:
            _loaded.add(name)
            try:
                importlib.import_module(name)
            except ImportError as exc:
                _loaded.discard(name)
                raise ValueError(f"{PLUGINS_ENV}: cannot import plugin module '{name}': {exc}") from None


def names() -> tuple[str, ...]:
    """Every method name, plugins included."""
    load_plugins()
    return tuple(METHODS)


def get(name: str) -> Method:
    """The record of train.method `name`; ValueError naming the field and the known methods."""
    load_plugins()
    if name not in METHODS:
        raise ValueError(f"train.method: unknown '{name}'; known: {', '.join(sorted(METHODS))}")
    return METHODS[name]
