"""Non-finite logits: how a decoding loop learns of them without waiting on the device, and the error.

A pick (argmax or draw) from logits that are not all finite has no meaning: greedy takes whichever
index NaN lands on, a draw from NaN probabilities returns token 0, the accept rule compares against
NaN and beam scores become NaN. So wherever tokens are picked, the logits are tested too (NaN or +-inf
anywhere): a backend's own picks (plain steps, draft phases, in C++ or in a compiled graph) return
NONFINITE in place of the token (the step goes on with a valid token, so no index goes out of range);
the speculative loop tests the verified logits, beam search the log-probs of its live beams. The result
comes back with what the loop reads from the device anyway; the loop raises `NonFiniteLogits` for the
first step it would have kept (one after an EOS or past max_length changes nothing and is ignored).

Which step is named: the first whose logits the decode read, exactly, where attention reads only the
positions a query may see (the CPU kernels' causal attention reads slots up to its own). A pass
that attends positions under a mask (speculative beam search's trees on every path; verify passes on
torch's and the compiled path) adds -inf to their scores, and NaN + -inf is NaN: a NaN key or value in a
hidden draft reaches the positions before it, and the error comes up to gamma steps early (possibly for
a draft plain decoding never reaches). torch's CPU attention returns zeros for a query whose every
score is NaN, so on its paths such a NaN may never reach the logits; the kernels keep it NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

NONFINITE = -1  # in place of a token picked from logits that were not all finite
NONFINITE_DRAFT = -2  # the same, for the draft's (early-exit head's) logits, where a loop tells them apart


def marked(logits: Tensor, token: Tensor) -> Tensor:
    """token (rows,) picked from logits (rows, V), NONFINITE where a row's logits are not all finite:
    the torch and compiled backends' marker, read by the loop with the tokens (no extra wait on the
    device; the C++ kernels mark the same way)."""
    return torch.where(torch.isfinite(logits).all(dim=-1), token, NONFINITE)


class NonFiniteLogits(ValueError):
    """The model's logits were not all finite (NaN or inf) at a step whose token decoding needed.

    row: the batch index of the sequence (beam search: of the item); step: the generated position
    (0: the first token after the start token); head: "target" (the full decoder) or "draft" (the
    early-exit head, read by speculative sampling's accept rule)."""

    def __init__(self, row: int, step: int, head: str = "target") -> None:
        super().__init__(row, step, head)  # args in this order: the exception pickles and unpickles
        self.row, self.step, self.head = row, step, head

    def __str__(self) -> str:
        which = "target's" if self.head == "target" else "draft's (early-exit head's)"
        return (f"the {which} logits are not finite (NaN or inf) for row {self.row} at step {self.step} "
                "(generated position, from 0): the model's weights or inputs hold NaN/inf, or overflow")


def first_marked(rows: list[int], new: list[list[int]], done: list[int], eos: int | None, max_length: int) -> None:
    """Raise for the earliest marked step a loop would keep. rows: the batch index of each sequence;
    new: each sequence's tokens of this iteration, NONFINITE or NONFINITE_DRAFT at a step picked from
    non-finite logits; done: tokens each sequence already holds. Ties: the lowest row."""
    if min(map(min, new)) >= 0:  # the common case: nothing marked
        return
    found = []
    for i, tokens, have in zip(rows, new, done):
        j = next((j for j, t in enumerate(tokens) if t < 0 or t == eos), None)
        if j is not None and tokens[j] < 0 and have + j < max_length:
            found.append((have + j, i, "draft" if tokens[j] == NONFINITE_DRAFT else "target"))
    if found:
        step, row, head = min(found)
        raise NonFiniteLogits(row, step, head)
