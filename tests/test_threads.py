"""Stages run in threads inside a flow: concurrent model loads must not interfere."""
from concurrent.futures import ThreadPoolExecutor

from pipeline.models.engines import SamplingParams
from pipeline.models.engines.hf import TransformersEngine
from stages.base_model import model_path


def test_concurrent_engines_sample_like_sequential_ones(base_manifest):
    path = model_path(base_manifest)

    def sample(seed):
        out = TransformersEngine(path).generate(["Q:123456\nA:"] * 16, SamplingParams(4, 1.0, 1.0, 20, seed))
        return [c.token_ids for g in out for c in g]
    sequential = [sample(s) for s in range(4)]
    with ThreadPoolExecutor(4) as ex:
        concurrent = list(ex.map(sample, range(4)))
    assert concurrent == sequential
