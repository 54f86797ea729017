"""Does an exit head fitted toward beam search's own choices commit more beam steps per cycle?

A speculative beam cycle at gamma 1 commits a second step only when all K beams the target picks are
among the W candidates the draft ranks highest (its scores: the target's beam score + the draft's
log-probs). This tool records plain beam search on the shipped model (every step of every item: the
exit states, the live beams' scores, the target's log-probs and the beams it picked), fits a copy of the
exit head toward those picks (trunk frozen), keeps the head whose hit rate (all K picks in the draft's
top W) is best on a tenth of the sentences set aside, and reports before / after:

- the hit rate on the set-aside steps,
- beam steps committed per cycle by speculative beam search on held-out sentences (gamma 1, W),
- the head's sampling acceptance (mean of sum_x min(p, q) on the target's samples of those sentences).

Losses: "margin" (each picked candidate's draft score above the (W-K+1)-th best unpicked one by
`--margin`, softplus hinge) or "joint" (KL from the target's to the draft's softmax over all K x V
candidates of an item, the beams' scores included).

    .venv/bin/python tools/beam_draft_fit.py --sentences 800 --steps 2000 --loss margin
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import Tensor

from tts_specdec import SpeculativeDecoder, beam
from tts_specdec.beam import BeamState
from tts_specdec.decoder import Decoder
from tts_specdec.distill import _record
from tts_specdec.results import DecodeStats
from tts_specdec.speech.checkpoint import load_checkpoint
from tts_specdec.speech.pipeline import ASSETS, default_max_length
from tts_specdec.speech.references import heldout_sentences
from tts_specdec.speech.sentences import generate_sentences

Steps = tuple[Tensor, Tensor, Tensor, Tensor]  # per item-step: exit states (K, dim), scores (K,), log p (K, V), picked (K, V)


@torch.no_grad()
def record(dec: Decoder, source: Tensor, k: int, max_length: int) -> Steps:
    """Plain beam search (`beam.beam_search_loop`, "standard" semantics, length penalty 1), watched: its
    target pass runs split at the exit layer (the same layers) to keep the exit states, and each
    `beam_step` is seen with the live beams' scores before it and the beams it picked."""
    exit_states, out_s, out_lp, out_pick = [], [], [], []
    all_layers = range(dec.depth)

    def verify(x: Tensor, start: int, layers: range, enc, cache) -> Tensor:
        assert layers == all_layers
        h = dec.run(x, start, range(dec.exit_layer), enc, cache)
        exit_states.append(h[:, -1])
        return dec.target_logits(dec.run(h, start, range(dec.exit_layer, dec.depth), enc, cache))

    def step(state: BeamState, lp: Tensor, last: bool = False):
        a, scores = state.active, state.scores.clone()
        out = plain_step(state, lp, last)
        picked = torch.zeros(a * k, lp.shape[1], dtype=torch.bool)
        picked[out.parents, out.tokens] = True  # the items still active: their new live beams
        out_s.append(scores[out.kept])
        out_lp.append(lp.view(a, k, -1)[out.kept])
        out_pick.append(picked.view(a, k, -1)[out.kept])
        exit_states[-1] = exit_states[-1].view(a, k, -1)[out.kept]
        return out

    plain_step = beam.beam_step
    dec.backend.verify, beam.beam_step = verify, step
    try:
        beam.beam_search_loop(dec, source, beam_size=k, length_penalty=1.0, max_length=max_length, cond_scale=1.0)
    finally:
        del dec.backend.verify  # the backend's own method again
        beam.beam_step = plain_step
    return torch.cat(exit_states), torch.cat(out_s), torch.cat(out_lp), torch.cat(out_pick)


def candidate_scores(head: torch.nn.Module, h: Tensor, scores: Tensor, eos: int | None) -> Tensor:
    """(n, K * V) the draft's scores of every candidate, EOS blocked as `spec_beam.draft` blocks it."""
    lq = head(h).float().log_softmax(-1)
    if eos is not None:
        blocked = torch.zeros(lq.shape[-1], dtype=torch.bool)
        blocked[eos] = True
        lq = lq.masked_fill(blocked, -math.inf)
    return (scores[..., None].float() + lq).flatten(1)


def hit_rate(head: torch.nn.Module, steps: Steps, width: int, eos: int | None) -> float:
    h, s, _, picked = steps
    with torch.no_grad():
        cand = candidate_scores(head, h, s, eos)
        top = torch.zeros_like(cand, dtype=torch.bool).scatter_(1, cand.topk(width, dim=1).indices, True)
        return ((picked.flatten(1) & ~top).sum(1) == 0).float().mean().item()


def loss_of(kind: str, head: torch.nn.Module, steps: Steps, k: int, width: int, margin: float,
            eos: int | None) -> Tensor:
    h, s, lp, picked = steps
    cand = candidate_scores(head, h, s, eos)
    pick = picked.flatten(1)
    if kind == "margin":
        rival = cand.masked_fill(pick, -math.inf).topk(width - k + 1, dim=1).values[:, -1:]
        gap = torch.nn.functional.softplus(rival - cand + margin)
        return torch.where(pick, gap, torch.zeros_like(gap)).sum(1).mean()
    target = s[..., None].float() + lp.float()
    if eos is not None:
        target[..., eos] = -math.inf
    log_p = target.flatten(1).log_softmax(1)
    log_q = cand.log_softmax(1)
    live = torch.isfinite(log_p)
    terms = log_p.exp() * (log_p - torch.where(live, log_q, torch.zeros_like(log_q)))
    return torch.where(live, terms, torch.zeros_like(terms)).sum(1).mean()


def steps_per_cycle(model: torch.nn.Module, texts: list[str], k: int, width: int) -> tuple[float, list[int]]:
    dec = SpeculativeDecoder(model)
    stats = []
    for text in texts:
        src = model.tokenizer_encode([text])
        stats.append(dec.beam_search(src, beam_size=k, gamma=1, draft_width=width,
                                     max_length=default_max_length(src)).stats)
    hist = DecodeStats.total(stats).committed_hist
    return sum(n * c for n, c in enumerate(hist)) / sum(hist), hist


def sampling_acceptance(model: torch.nn.Module, states: Tensor, log_p: Tensor) -> float:
    with torch.no_grad():
        q = model.to_early_exit_semantic_logits(states).softmax(-1)
        return torch.minimum(log_p.exp(), q).sum(-1).mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=800, help="training sentences (a tenth set aside)")
    p.add_argument("--heldout", type=int, default=24, help="held-out sentences for the decoding figures")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=256, help="item-steps per training step")
    p.add_argument("--loss", choices=("margin", "joint"), default="margin")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--margin", type=float, default=1.0)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--draft-width", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    k, width = args.beam_size, args.draft_width
    model = load_checkpoint(ASSETS).model.eval()
    dec = SpeculativeDecoder(model).decoder
    held_texts = heldout_sentences(args.heldout)
    skip = set(heldout_sentences(50))
    texts = [t for t in generate_sentences(args.sentences + len(skip), seed=2024) if t not in skip][: args.sentences]
    start = time.perf_counter()
    parts = []
    for first in range(0, len(texts), 16):
        src = model.tokenizer_encode(texts[first : first + 16])
        parts.append(record(dec, src, k, default_max_length(src)))
    aside = max(1, len(parts) // 10)
    train = tuple(torch.cat(x) for x in zip(*parts[:-aside]))
    hold = tuple(torch.cat(x) for x in zip(*parts[-aside:]))
    print(f"recorded {len(train[0])} + {len(hold[0])} item-steps of beam search ({time.perf_counter() - start:.0f} s)")
    src = model.tokenizer_encode(held_texts)
    states, log_p, _ = _record(SpeculativeDecoder(model), src, 400, 25, 1.0, args.seed, False)

    head, eos = model.to_early_exit_semantic_logits, dec.eos_id
    head.eval()

    def report(when: str) -> None:
        spc, hist = steps_per_cycle(model, held_texts, k, width)
        print(f"{when}: hit rate {hit_rate(head, hold, width, eos):.4f} (set aside), "
              f"beam steps per cycle {spc:.3f} {hist} ({len(held_texts)} held-out sentences), "
              f"sampling acceptance {sampling_acceptance(model, states, log_p):.4f}", flush=True)

    report("before")
    params = list(head.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    best, kept = hit_rate(head, hold, width, eos), [q.detach().clone() for q in params]
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:  # warm-up, then cosine down to a tenth (as distill.py)
            group["lr"] = args.lr * min(1.0, step / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps)))
        pick = torch.randint(0, len(train[0]), (args.batch,), generator=gen)
        value = loss_of(args.loss, head, tuple(x[pick] for x in train), k, width, args.margin, eos)
        opt.zero_grad()
        value.backward()
        opt.step()
        if step % 100 == 0 or step == args.steps:
            now = hit_rate(head, hold, width, eos)
            if now > best:
                best, kept = now, [q.detach().clone() for q in params]
            print(f"step {step}: loss {value.item():.4f}, hit rate {now:.4f} (best {best:.4f})", flush=True)
    with torch.no_grad():
        for q, b in zip(params, kept):
            q.copy_(b)
    report("after")


if __name__ == "__main__":
    main()
