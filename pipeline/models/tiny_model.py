"""The built-in tiny policy: a standard Qwen3ForCausalLM with a character-level tokenizer.

Saved as an ordinary HF folder (config.json, model.safetensors, tokenizer.json), so it
loads with AutoModelForCausalLM / AutoTokenizer and with vLLM. The tokenizer is a
`tokenizers` BPE model with no merges over 96 characters (printable ASCII and newline)
plus pad/bos/eos/unk: every character is one token. Sizes: docs/measurements.md, The tiny
model (hidden 128, 2 layers: ~0.54 M parameters, 0.12 s per SFT step at batch 64).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from pipeline.core.config import ModelConfig
from pipeline.core.seeding import derive_seed
from pipeline.models import numerics

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def build_model(cfg: ModelConfig, vocab_size: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, intermediate_size=cfg.intermediate_size,
        # RoPE sets no hard limit; 4,096 lets a preset's long response budgets (3,072 tokens)
        # pass preflight with the tiny model standing in for a real one
        max_position_embeddings=4096, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(derive_seed(cfg.init_seed, "model/init"))
    return numerics.prepare(Qwen3ForCausalLM(config))


def save(model, tokenizer, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # transformers 5 writes tokenizer_class "TokenizersBackend"; older loaders (vLLM) need this
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
