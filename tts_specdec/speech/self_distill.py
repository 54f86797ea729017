"""On-policy data for exit-head distillation: the model's own greedy unit sequences.

Teacher forcing on recorded units trains the draft where the data is; greedy speculative decoding
asks it to agree with the target where the target's *own* outputs are. Distilling on those
sequences closes that gap.
"""

from __future__ import annotations

import torch
from spear_tts_pytorch import TextToSemantic
from tqdm import tqdm

from .dataset import PairedData, pad_stack


@torch.no_grad()
def greedy_pairs(model: TextToSemantic, data: PairedData, n: int, *, batch_size: int = 32,
                 seed: int = 0) -> PairedData:
    """Greedy-decode the texts of `n` random items of `data`; returns (text, generated units) pairs."""
    from tts_specdec import SpeculativeDecoder  # the package root imports speech lazily

    if not 0 < n <= len(data):
        raise ValueError(f"n must be in 1..{len(data)}, got {n}")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:n].tolist()
    decoder = SpeculativeDecoder(model)
    texts, text_ids, units = [], [], []
    for start in tqdm(range(0, n, batch_size), desc="greedy units for distillation"):
        items = order[start:start + batch_size]
        source = pad_stack([data.text_ids[i] for i in items], model.text_pad_id)
        longest = max(len(data.units[i]) for i in items)
        out = decoder.sample(source, temperature=0.0, max_length=2 * longest + 20)
        for i, tokens in zip(items, out.tokens):
            tokens = tokens[tokens < model.semantic_pad_id]  # keep units only
            if tokens.numel():
                texts.append(data.texts[i])
                text_ids.append(data.text_ids[i])
                units.append(tokens.cpu())
    return PairedData(texts, text_ids, units)
