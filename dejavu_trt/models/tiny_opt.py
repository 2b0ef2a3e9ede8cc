"""A small OPT trained briefly on the corpus, to exercise the OPT code paths offline.

No OPT weights can be downloaded here, and random weights only prove that shapes fit: a trained
ReLU MLP has the sparse activations DejaVu relies on, a random one does not. This trains a
4-layer OPT (d=128) for a few hundred steps on 2 CPU cores and caches it as an HF folder. Its
tokenizer is a 4096-token byte-level BPE trained on the same corpus in seconds: a 49k-token
vocabulary (the only pretrained tokenizer available offline) would make the LM head dominate
training time.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from ..artifacts import atomic_dir, atomic_write_json
from ..paths import cache_dir

log = logging.getLogger(__name__)

TINY_OPT_CONFIG = dict(hidden_size=128, ffn_dim=512, num_hidden_layers=4, num_attention_heads=4,
                       max_position_embeddings=512, activation_function="relu", do_layer_norm_before=True,
                       word_embed_proj_dim=128, dropout=0.0, attention_dropout=0.0, enable_bias=True)
TINY_OPT_VERSION = 2  # bump when the recipe changes so cached copies are rebuilt


def tiny_opt_dir() -> Path:
    return cache_dir() / "models" / f"tiny-opt-v{TINY_OPT_VERSION}"


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer trained on `texts` (deterministic), as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="</s>")


def train_tiny_opt(out: Path | None = None, steps: int = 300, seq_len: int = 128, batch: int = 16,
                   corpus: str = "sotu", seed: int = 0, progress: bool = True) -> Path:
    """Train (or reuse) the tiny OPT and return its folder. Deterministic for a given seed."""
    from transformers import OPTConfig, OPTForCausalLM

    from ..data.corpus import load_documents, split_windows, tokenize_documents

    out = Path(out) if out else tiny_opt_dir()
    if (out / "config.json").is_file():
        return out
    docs = load_documents(corpus)
    tokenizer = train_tokenizer([d.text for d in docs])
    stream = tokenize_documents(docs, tokenizer)
    windows = split_windows(stream, seq_len)["calibration"]

    torch.manual_seed(seed)
    config = OPTConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id or 0,
                       bos_token_id=tokenizer.bos_token_id or 0, eos_token_id=tokenizer.eos_token_id or 0,
                       **TINY_OPT_CONFIG)
    model = OPTForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    it = range(steps)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="training tiny OPT", unit="step")
    for step in it:
        rows = torch.randint(0, windows.shape[0], (batch,), generator=gen)
        x = windows[rows]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress:
            it.set_postfix(loss=f"{loss.item():.2f}")
    model.eval()
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "dejavu_source.json", {"recipe": "tiny-opt", "version": TINY_OPT_VERSION,
                                                       "steps": steps, "final_loss": float(loss.item())})
    return out
