"""The shipped TextToSemantic: configuration and construction.

Semantic ids: 0..n_units-1 are k-means units, `n_units` is padding, `n_units + 1` is EOS.
Upstream `forward()` embeds target ids directly, so padding must be a valid embedding row that is
not EOS; we reserve one extra id for it (num_semantic_token_ids = n_units + 1, EOS autoset after it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional

import torch
from spear_tts_pytorch import TextToSemantic


@dataclass(frozen=True)
class ModelConfig:
    n_units: int = 128
    num_text_token_ids: int = 34
    dim: int = 128
    source_depth: int = 3
    target_depth: int = 16
    target_early_exit_layer: int = 2
    heads: int = 2
    dim_head: int = 64
    target_kv_heads: Optional[int] = None
    ff_mult: int = 2
    cond_drop_prob: float = 0.1

    def __post_init__(self):
        if not 0 < self.target_early_exit_layer <= self.target_depth:
            raise ValueError(f"target_early_exit_layer must be in 1..{self.target_depth}")
        if self.n_units < 2 or self.num_text_token_ids < 2:
            raise ValueError("n_units and num_text_token_ids must be at least 2")

    @property
    def semantic_pad_id(self) -> int:
        return self.n_units

    @property
    def semantic_eos_id(self) -> int:
        return self.n_units + 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}")
        return cls(**data)


def build_model(config: ModelConfig, tokenizer_encode: Optional[Callable] = None) -> TextToSemantic:
    model = TextToSemantic(
        dim=config.dim,
        source_depth=config.source_depth,
        target_depth=config.target_depth,
        num_text_token_ids=config.num_text_token_ids,
        tokenizer_encode=tokenizer_encode,
        num_semantic_token_ids=config.n_units + 1,  # + the padding id
        semantic_pad_id=config.semantic_pad_id,
        dim_head=config.dim_head,
        heads=config.heads,
        target_kv_heads=config.target_kv_heads,
        ff_mult=config.ff_mult,
        cond_drop_prob=config.cond_drop_prob,
        target_early_exit_layer=config.target_early_exit_layer,
    )
    # The logit heads are tied to the embeddings and read RMS-normed states of norm sqrt(dim):
    # upstream's N(0, 1) embeddings give initial logits of std sqrt(dim) (loss ~25 instead of ~5),
    # which slows early training badly; std dim**-0.5 starts at unit-scale logits.
    for embedding in model.token_emb.values():
        torch.nn.init.normal_(embedding.weight, std=config.dim ** -0.5)
    return model
