"""How many tokens a verify pass could yield with token trees instead of one chain, from the exit head's
ranks along greedy decoding: the ceiling of tree drafts for this model's head, before building them.

Greedy decoding's tokens are decoded plainly (`gamma=0`), then one teacher-forced pass over each sentence
gives the exit head's rank of the target's token at every position. A cycle's accepted drafts follow the
greedy path, so these ranks decide every tree shape exactly (no sampling, no timing):

- chain: gamma drafts, the draft's first choice at each depth (what `sample(..., gamma=g)` drafts);
- siblings: the chain plus the draft's next k - 1 choices at each depth as leaves (a sibling equal to the
  target's token is accepted and the target's token after it is the bonus);
- sub-chains: the chain, and each sibling the start of its own chain down to depth gamma (one level of
  branching: siblings of sibling chains are not drafted).

Sampling (`--sampling`): along paths sampled plainly (temperature 1, seeded), each position's chance that
a draft from the head is accepted, beta = sum min(p, q), and that a second draft drawn from the head is
accepted once the first was not (SpecInfer's recursive rejection: sum min(r, q), r the residual
max(p - q, 0) normalised). A chain's tokens a cycle, and with one such sibling leaf beside every draft,
are their expectations over every start (the chances read along the sampled path, as the field's
estimates are).

For each shape it prints the tokens a cycle yields and the nodes a verify pass carries (plus the pending
token), beside a chain with as many drafts as the tree has nodes: on this machine a verify pass of
rows n costs about the same for n <= 8-9 and more above (`tools/gemm_rows.py`), so a tree pays only where
it yields more than the chain of the same node count.

    python tools/tree_ceiling.py                        # shipped head, 48 held-out sentences
    python tools/tree_ceiling.py --sentences 100 --k 2 3 --json benchmarks/tree_ceiling.json
    python tools/tree_ceiling.py --sampling --sentences 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decoded_paths(sentences: int, temperature: float):
    """Per held-out sentence with tokens, plain decoding's tokens at `temperature` (seeded) and the exit
    head's and the target's logits at every position of that path, teacher-forced in one pass each."""
    from tts_specdec import SpeculativeDecoder
    from tts_specdec.speech.checkpoint import load_checkpoint
    from tts_specdec.speech.pipeline import ASSETS, default_max_length
    from tts_specdec.speech.references import heldout_sentences

    sd = SpeculativeDecoder(load_checkpoint(ASSETS).model.eval())
    dec = sd.decoder
    with torch.no_grad():
        for i, text in enumerate(heldout_sentences(sentences)):
            source = sd.model.tokenizer_encode([text])
            tokens = sd.sample(source, temperature=temperature, gamma=0, max_length=default_max_length(source),
                               generator=torch.Generator().manual_seed(i)).tokens[0]
            if len(tokens) == 0:
                continue
            enc = dec.encode(source)
            cache = dec.new_cache(1, len(tokens) + 2)
            x = torch.cat([dec.start(1), dec.embed(tokens[None, :-1])], dim=1)
            exit_states = dec.run(x, 0, range(0, dec.exit_layer), enc, cache)
            draft = dec.draft_logits(exit_states)[0]
            target = dec.target_logits(dec.run(exit_states, 0, range(dec.exit_layer, dec.depth), enc, cache))[0]
            yield tokens, draft, target


def draft_ranks(sentences: int) -> tuple[list[list[int]], float]:
    """Per sentence, the exit head's rank (1: its first choice) of greedy decoding's token at each position;
    and the share of positions where the teacher-forced target's argmax equals the decoded token (1.0:
    the ranks describe the path greedy decoding took)."""
    ranks, same, total = [], 0, 0
    for tokens, draft, target in decoded_paths(sentences, 0.0):
        same += int((target.argmax(-1) == tokens).sum())
        total += len(tokens)
        ranks.append(((draft > draft.gather(1, tokens[:, None])).sum(1) + 1).tolist())
    return ranks, same / max(total, 1)


def acceptance(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of target and draft probabilities (rows, V): the chance a draft drawn from q is accepted
    against p, and that a second one drawn from q is accepted against the residual once the first was not
    (0 where the first always is)."""
    first = torch.minimum(p, q).sum(-1)
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    second = torch.where(mass[:, 0] > 0, torch.minimum(residual / mass.clamp(min=1e-30), q).sum(-1), torch.zeros_like(first))
    return first, second


def sampled_acceptance(sentences: int) -> list[tuple[list[float], list[float]]]:
    """Per sentence sampled at temperature 1: `acceptance` at each position of the path."""
    out = []
    for _, draft, target in decoded_paths(sentences, 1.0):
        first, second = acceptance(target.float().softmax(-1), draft.float().softmax(-1))
        out.append((first.tolist(), second.tolist()))
    return out


def second_accepted(pairs: list[tuple[float, float]]) -> float:
    """The chance a second draft is accepted once the first was not, over positions' (first, second)
    chances (`acceptance`): each position weighted by how often its first draft is rejected."""
    rejected = sum(1 - first for first, _ in pairs)
    return sum((1 - first) * second for first, second in pairs) / rejected if rejected > 0 else 0.0


def expected_cycle_tokens(first: list[float], second: list[float], gamma: int, leaves: bool) -> float:
    """A cycle's expected tokens, averaged over every start that leaves gamma positions: a chain of gamma
    drafts accepted with chances `first`, and with `leaves` a second draft beside each, accepted with
    chance `second` where the first was not (its bonus token follows)."""
    starts = range(len(first) - gamma + 1)
    total = 0.0
    for p in starts:
        reach, tokens = 1.0, 1.0
        for k in range(gamma):
            if leaves:
                tokens += reach * (1 - first[p + k]) * second[p + k]
            reach *= first[p + k]
            tokens += reach
        total += tokens
    return total / max(len(starts), 1)


def cycle_tokens(row: list[int], p: int, gamma: int, k: int, levels: int, leaves: bool) -> int:
    """Tokens one cycle from position p yields. A draft of rank 1 is accepted; one of rank 2..k is accepted
    as a sibling while `levels` branchings are left; with `leaves` a sibling ends the cycle (the target's
    token after it is the bonus), else its chain goes on to depth gamma. The cycle's correction or bonus
    token counts, but not past the row's end."""
    depth, left = 0, levels
    while depth < gamma and p + depth < len(row):
        rank = row[p + depth]
        if rank == 1:
            depth += 1
        elif rank <= k and left > 0:
            left -= 1
            depth += 1
            if leaves:
                break
        else:
            break
    return min(depth + 1, len(row) - p)


def tokens_per_cycle(ranks: list[list[int]], gamma: int, k: int, levels: int, leaves: bool) -> float:
    """Tokens a cycle yields on average (`cycle_tokens`), each cycle starting where the last one ended."""
    cycles = tokens = 0
    for row in ranks:
        p = 0
        while p < len(row):
            got = cycle_tokens(row, p, gamma, k, levels, leaves)
            cycles += 1
            tokens += got
            p += got
    return tokens / cycles


def sub_chain_nodes(gamma: int, k: int, levels: int) -> int:
    """Drafted nodes of a tree whose chain nodes each have k - 1 siblings starting chains to depth gamma,
    `levels` branchings deep."""
    if gamma <= 0:
        return 0
    nodes = gamma
    if levels > 0:
        for depth in range(1, gamma + 1):
            nodes += (k - 1) * (1 + sub_chain_nodes(gamma - depth, k, levels - 1))
    return nodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=48, help="held-out sentences (default 48)")
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4, 5, 6], help="tree depths")
    p.add_argument("--k", type=int, nargs="+", default=[2, 3], help="choices per node (1 + siblings)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sampling", action="store_true", help="sampling's chances instead of greedy ranks")
    p.add_argument("--json", type=Path, help="write the table here")
    args = p.parse_args()
    if args.sentences < 1 or min(args.gammas) < 1 or min(args.k) < 2:
        p.error("--sentences and --gammas must be >= 1, --k >= 2")
    torch.set_num_threads(args.threads)
    if args.sampling:
        sampling(args)
        return
    ranks, same = draft_ranks(args.sentences)
    flat = [r for row in ranks for r in row]
    first = sum(r == 1 for r in flat) / len(flat)
    top = {k: sum(r <= k for r in flat) / len(flat) for k in args.k}
    print(f"{len(ranks)} sentences, {len(flat)} positions; teacher-forced target equals greedy's tokens at "
          f"{same:.3f}; the draft's first choice is the target's token at {first:.3f}, "
          + ", ".join(f"one of its first {k} at {v:.3f}" for k, v in top.items()))
    rows = []
    print("shape                      gamma  k  nodes  tokens/cycle  chain of as many drafts")
    for gamma in args.gammas:
        chain = tokens_per_cycle(ranks, gamma, 1, 0, True)
        print(f"chain                      {gamma:5d}  -  {gamma:5d}  {chain:12.3f}")
        rows.append(dict(shape="chain", gamma=gamma, k=1, nodes=gamma, tokens=chain))
        for k in args.k:
            for shape, nodes, leaves in (("siblings", gamma * k, True), ("sub-chains", sub_chain_nodes(gamma, k, 1), False)):
                got = tokens_per_cycle(ranks, gamma, k, gamma if leaves else 1, leaves)
                same_nodes = tokens_per_cycle(ranks, nodes, 1, 0, True)
                print(f"{shape:26s} {gamma:5d} {k:2d}  {nodes:5d}  {got:12.3f}  {same_nodes:12.3f}")
                rows.append(dict(shape=shape, gamma=gamma, k=k, nodes=nodes, tokens=got, chain_same_nodes=same_nodes))
    if args.json:
        write_json(args.json, dict(sentences=len(ranks), positions=len(flat), first_choice=first, top_k=top,
                                   greedy_path_agreement=same, rows=rows))


def sampling(args: argparse.Namespace) -> None:
    paths = [path for path in sampled_acceptance(args.sentences) if len(path[0]) >= 2 * max(args.gammas)]
    pairs = [(b, s) for first, second in paths for b, s in zip(first, second)]
    accepted = sum(b for b, _ in pairs) / len(pairs)
    second = second_accepted(pairs)
    print(f"{len(paths)} sampled sentences, {len(pairs)} positions: a draft accepted with chance "
          f"{accepted:.3f} on average; a second draft, once the first was not, {second:.3f}")
    rows = []
    print("gamma  chain  sibling leaves (nodes 2 gamma)  chain of 2 gamma drafts")
    for gamma in args.gammas:
        chain, leaves, double = (sum(expected_cycle_tokens(f, s, g, lv) for f, s in paths) / len(paths)
                                 for g, lv in ((gamma, False), (gamma, True), (2 * gamma, False)))
        print(f"{gamma:5d}  {chain:5.3f}  {leaves:30.3f}  {double:22.3f}")
        rows.append(dict(gamma=gamma, chain=chain, sibling_leaves=leaves, chain_twice_as_long=double))
    if args.json:
        write_json(args.json, dict(sentences=len(paths), positions=len(pairs), first_accepted=accepted,
                                   second_accepted=second, rows=rows))


if __name__ == "__main__":
    main()
