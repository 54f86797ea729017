"""How often the search loops read device values back to the host, or send host data to the device, under
`compile=True`, the GPU path: on a GPU each waits for the device, so the bookkeeping between graphs must
do either rarely. Counted on the CPU with a torch function mode around everything but the static steps
themselves, which run uncompiled here (the same functions `torch.compile` captures; that they read
nothing is what fullgraph=True proves in tests/test_compiled.py). The bounds are what the loops do now:
a change that adds a read or a send per step or per cycle fails here."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tts_specdec import SpeculativeDecoder, beam, speculative
from tts_specdec.backends import StaticCompiled

from conftest import make_source, uncompiled_graph
from test_spec_beam import draft_model

pytestmark = pytest.mark.usefixtures("one_thread")

# tensor methods and functions whose result on the host depends on device values
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "bincount", "unique",
         "masked_select", "numpy"}


class HostReads(TorchFunctionMode):
    """Counts reads (`READS`) and sends: host data copied to the model's device (`torch.tensor` with a
    device, `Tensor.to` a device), which PyTorch also completes before going on (it waits for the GPU's
    queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.sends = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.calls[name] = self.calls.get(name, 0) + 1
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.sends += 1
        elif name == "to" and (kwargs.get("device") is not None or any(
                isinstance(a, (torch.device, str)) for a in args[1:])):
            self.sends += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture
def dec(monkeypatch):
    """The partial draft (some cycles commit several steps), float64, on the static path with every item
    running to max_length (no EOS): steps and cycles are counted alike in every mode."""
    monkeypatch.setattr(StaticCompiled, "_graph", uncompiled_graph)
    monkeypatch.setattr(beam, "transfers_wait", lambda device: True)  # as on a GPU
    d = SpeculativeDecoder(draft_model("partial", dtype=torch.float64), compile="eager")
    d.decoder.eos_id = None
    return d


SOURCE = make_source(2, 7, seed=5)
MAX_LEN = 40
# reads and sends once per decode, around the loop: the source's checks, the encoder's, the results
SETUP = 6
SETUP_SENDS = 5


def _count(run):
    with HostReads() as reads:
        out = run()
    assert [t.numel() for t in out.tokens] == [MAX_LEN] * 2
    return reads, out.stats


def test_plain_beam_search_reads_once_per_step(dec):
    """One read per beam step: the ranked candidates (scores and indices together); the beams' reorder
    and the results read nothing more, and no step sends anything."""
    reads, stats = _count(lambda: dec.beam_search(SOURCE, beam_size=3, max_length=MAX_LEN, gamma=0))
    assert stats.steps == MAX_LEN
    assert reads.total <= stats.steps + SETUP, reads.calls
    assert reads.sends <= SETUP_SENDS  # none per step: the new beams are computed on the device too


@pytest.mark.parametrize("semantics", ["standard", "upstream"])
def test_speculative_beam_search_reads(dec, semantics):
    """Per cycle: the draft tree's (parent, token) pairs and one read per beam step replayed (the one that
    left the tree included), nothing to size the passes (static shapes)."""
    reads, stats = _count(lambda: dec.beam_search(SOURCE, beam_size=3, max_length=MAX_LEN, gamma=3, draft_width=4,
                                                  beam_semantics=semantics))
    cycles, replayed = stats.steps, sum(n * c for n, c in enumerate(stats.committed_hist))
    assert any(stats.committed_hist[2:]), stats.committed_hist  # some cycles committed several steps
    results = SOURCE.shape[0] if semantics == "upstream" else 0  # spear-tts's: each item's first beam's score
    assert reads.total <= cycles + replayed + results + SETUP, (reads.calls, cycles, replayed)
    assert reads.sends <= cycles + SETUP_SENDS  # one per cycle: the committed beams' tree nodes


@pytest.mark.parametrize("gamma,confidence", [(0, None), (4, None), (4, 0.6)], ids=["plain", "spec", "stops"])
def test_sampling_reads_once_per_cycle(dec, gamma, confidence):
    """Plain sampling: one read per run of up to PLAIN_STEPS steps; speculative sampling (draft stops
    too): one per cycle (accepted counts, next tokens, checks, drafts and proposed counts together)."""
    reads, stats = _count(lambda: dec.sample(SOURCE, temperature=1.0, gamma=gamma, draft_confidence=confidence,
                                             max_length=MAX_LEN, generator=torch.Generator().manual_seed(0)))
    calls = -(-MAX_LEN // speculative.PLAIN_STEPS) if gamma == 0 else stats.target_passes
    if gamma:
        assert stats.drafted and stats.accepted  # cycles drafted and accepted
    assert reads.total <= calls + SETUP, reads.calls
    assert reads.sends <= SETUP_SENDS + SOURCE.shape[0]  # none per cycle: positions advance on the device


@pytest.mark.parametrize("guided", [False, True], ids=["unguided", "guided"])
def test_speculative_cycle_takes_its_start_slot_from_host_positions(guided):
    """Outside the static path a speculative cycle's start slot comes from the loop's host positions
    (`Decoder.start_of(..., known)`): the same answer as testing the device's positions, without their two
    reads per cycle (each a wait on a GPU)."""
    from conftest import make_model
    from tts_specdec.decoder import Decoder

    dec = Decoder(make_model(0))
    dec.begin()
    for known in ([3, 3, 3], [3, 5, 3]):
        pos = torch.tensor(known)
        with HostReads() as reads:
            start = dec.start_of(pos, guided, known)
        assert reads.total == 0, reads.calls
        reference = dec.start_of(pos, guided)
        assert start == reference if isinstance(reference, int) else torch.equal(start, reference)
    assert dec.start_of(torch.tensor([3, 3]), guided, [3, 3]) == 3
