"""Training losses for TextToSemantic with an early-exit head, computed from its own submodules.

We call the submodules rather than `TextToSemantic.forward` because forward returns only the final
loss, drops the condition for the whole batch at once, and adds its alignment regulariser;
here the condition is dropped per row (for classifier-free guidance) and both heads' logits are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from spear_tts_pytorch import TextToSemantic
from spear_tts_pytorch.spear_tts_pytorch import set_eos_id


@dataclass
class HeadLogits:
    final: torch.Tensor   # (batch, n + 1, vocab): target head, position i predicts target token i
    early: torch.Tensor   # (batch, n + 1, vocab): early-exit head (draft)
    target: torch.Tensor  # (batch, n + 1) units with EOS appended, padded with the pad id


def head_logits(model: TextToSemantic, text: torch.Tensor, units: torch.Tensor,
                drop_cond: torch.Tensor | None = None, *, trunk_grad: bool = True) -> HeadLogits:
    """Teacher-forced logits of both heads. text (b, n_text) padded with text_pad_id; units (b, n) with semantic_pad_id."""
    source = set_eos_id(text, model.eos_id["text"], pad_id=model.text_pad_id)
    source_mask = source != model.text_pad_id
    target = set_eos_id(units, model.eos_id["speech"], pad_id=model.semantic_pad_id)

    with torch.set_grad_enabled(trunk_grad and torch.is_grad_enabled()):
        context = model.source_transformer(model.token_emb["text"](source), source_mask)
        context_mask = source_mask if drop_cond is None else source_mask & ~drop_cond[:, None]
        start = repeat(model.start_token["speech"], "d -> b 1 d", b=units.shape[0])
        x = torch.cat((start, model.token_emb["speech"](target[:, :-1])), dim=1)
        # causal self-attention: padding sits after EOS, so it never reaches a real position
        out, hiddens = model.target_transformer(x, context=context, context_mask=context_mask,
                                                return_hiddens=True)
        final = model.to_logits["speech"](out)
        early_hidden = hiddens[model.early_exit_layer - 1]
    early = model.to_early_exit_semantic_logits(early_hidden)
    return HeadLogits(final=final, early=early, target=target)


def token_ce(logits: torch.Tensor, target: torch.Tensor, pad_id: int) -> torch.Tensor:
    return F.cross_entropy(rearrange(logits, "b n c -> b c n"), target, ignore_index=pad_id)


def distill_kl(early: torch.Tensor, final: torch.Tensor, target: torch.Tensor, pad_id: int) -> torch.Tensor:
    """KL(p_target || q_exit) per real token: pulls the draft toward the target's own distribution."""
    mask = target != pad_id
    log_p = final.detach().log_softmax(-1)
    log_q = early.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl[mask].mean()


@torch.no_grad()
def head_agreement(logits: HeadLogits, pad_id: int) -> dict[str, float]:
    """Teacher-forced diagnostics: accuracy of each head and draft/target argmax agreement, 1 - TV."""
    mask = logits.target != pad_id
    f, e = logits.final.argmax(-1), logits.early.argmax(-1)
    p, q = logits.final.softmax(-1), logits.early.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    return {
        "acc_final": (f == logits.target)[mask].float().mean().item(),
        "acc_early": (e == logits.target)[mask].float().mean().item(),
        "argmax_agree": (f == e)[mask].float().mean().item(),
        "accept_rate": (1 - tv)[mask].mean().item(),
    }
