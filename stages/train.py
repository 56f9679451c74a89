"""Stage `train`: one run of `train.method` on the fixed, filtered pool (spec 2, 7, 8.4).

Reads `seed`, `train`, `rollout` (group size, sampling temperature); inputs `base` (pi_0,
also the initial reference) and `pool` (the filter stage; for an imported pool
pool_import or score, graph.pool_stages). A pool without behavior log-probs refuses the
methods that need them, and on it the K3, |log rho| and ESS diagnostics are None. Writes
`model/` (an HF folder of the final policy), `metrics.parquet` (one row per update: loss,
reward, entropy, grad norm, clip fraction, K3 to the reference, response length, tokens)
and `checkpoints/`, which survive an interrupted build so that rerunning the same command
resumes there, and `snapshots/update_NNNNN/` every `train.eval_every` updates for
evaluation during training. Group order: `order.py`, the same for every method of a seed. Loss: `losses.py`.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.config import PipelineConfig
from pipeline.core.errors import TrainingError
from pipeline.core.schemas import TRAIN_METRICS, write_parquet
from pipeline.core.store import Manifest, Store, model_path
from pipeline.dag.spec import Built, StageSpec, run_stage
from pipeline.models.hf import load_tokenizer
from pipeline.tasks.pool_source import behavior_refusal
from pipeline.training import distributed, torchrun
from pipeline.training.loop import load_pool, snapshot_files, train
from pipeline.training.order import order_hash


def check(cfg: PipelineConfig, pool_manifest: Manifest) -> None:
    """Bad config against this pool: fail before any training."""
    stored_m = pool_manifest.config["rollout"]["group_size"]
    if stored_m != cfg.rollout.group_size:
        raise TrainingError(f"train: rollout.group_size={cfg.rollout.group_size} but the pool was "
                            f"built with group_size={stored_m}")
    if pool_manifest.summary.get("groups_kept", 0) == 0:
        raise TrainingError(f"train: the pool {pool_manifest.path('train_pool')} has no mixed-reward groups")
    if pool_manifest.summary.get("behavior_logprobs") == "none" and cfg.train.needs_behavior_logprobs():
        raise TrainingError(behavior_refusal(cfg.train, pool_manifest.summary.get("source", "the imported pool")))


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    import torch
    torch.set_num_threads(cfg.model.threads)
    check(cfg, inputs["pool"])
    base_path = model_path(inputs["base"])
    tokenizer = load_tokenizer(base_path)
    pool = load_pool(inputs["pool"].path("train_pool"), cfg.rollout.group_size, cfg.train)
    if distributed.wanted(cfg.train):     # torchrun, FSDP2 ranks running the same loop
        rows, reference = torchrun.launch(cfg, base_path, inputs["pool"].path("train_pool"), folder), {}
    else:
        st = train(cfg, pool, base_path, tokenizer, folder)
        rows, reference = st.rows, {"reference_forwards": st.ref_cache.computed,
                                    "reference_cache_hits": st.ref_cache.served}
    n = write_parquet({k: [r.get(k) for r in rows] for k in TRAIN_METRICS.names}, TRAIN_METRICS, folder / "metrics.parquet")
    tc = cfg.train
    snapshots = snapshot_files(tc.snapshot_updates())
    return Built(
        files={"metrics": ("metrics.parquet", n), "weights": ("model/model.safetensors", None)} | snapshots,
        summary={"method": tc.method, "seed": cfg.seed,     # the model: files["weights"] (model_path)
                 "t_ref": tc.refresh_every() or "fixed", "step_anchor": tc.needs_step_anchor(),
                 "updates": tc.updates, "pool_groups": len(pool.group_ids),
                 "pool_behavior_logprobs": inputs["pool"].summary.get("behavior_logprobs", "sampled"),
                 "group_order_sha256": order_hash(tc.updates, tc.groups_per_update, pool.group_ids, cfg.seed),
                 "final_reward": rows[-1]["reward"], "final_loss": rows[-1]["loss"],
                 "tokens_per_second": sum(r["tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9),
                 **reference})


SPEC = StageSpec(name="train", numerics=True, version=2, reads=("seed", "train", "rollout"), build=build,
                 keep_on_rebuild=("checkpoints", "snapshots"))


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
