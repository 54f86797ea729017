"""KVCache verbs: write, crop, reorder, repeat, grow."""

import pytest
import torch

from tts_specdec.cache import BufferPool, KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, ROWS, HEADS, CAP, DIM = 2, 4, 2, 8, 3


def filled(high: int = 5, dtype: torch.dtype = torch.float64) -> KVCache:
    """A cache whose every written slot holds a distinct value; positions < high written."""
    cache = KVCache(LAYERS, ROWS, HEADS, DIM, CAP, dtype=dtype, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        k = torch.randn(ROWS, HEADS, high, DIM, generator=g, dtype=dtype)
        cache.write(layer, k, -k, 0)
    cache.crop(torch.tensor([5, 3, 4, 1]))
    return cache


def test_write_at_one_position_returns_keys_up_to_the_end():
    cache = filled()
    k, v = torch.ones(ROWS, HEADS, 2, DIM, dtype=torch.float64), torch.zeros(ROWS, HEADS, 2, DIM, dtype=torch.float64)
    before = cache.k[1, :, :, :5].clone()
    keys, values = cache.write(1, k, v, 5)
    assert keys.shape == (ROWS, HEADS, 7, DIM) and values.shape == keys.shape
    assert torch.equal(keys[:, :, :5], before) and torch.equal(keys[:, :, 5:], k) and torch.equal(values[:, :, 5:], v)
    assert cache.high == 7
    assert cache.lengths.tolist() == [5, 3, 4, 1]  # writing does not commit


def test_ragged_write_puts_each_row_at_its_own_position():
    cache = filled()
    before, before_v = cache.k.clone(), cache.v.clone()
    start = torch.tensor([5, 3, 4, 1])
    k = torch.arange(ROWS * HEADS * 2 * DIM, dtype=torch.float64).view(ROWS, HEADS, 2, DIM) + 100
    keys, _ = cache.write(0, k, -k, start)
    assert keys.shape[2] == 7  # up to the furthest written position
    expected, expected_v = before[0].clone(), before_v[0].clone()
    for r, s in enumerate(start.tolist()):
        expected[r, :, s : s + 2] = k[r]
        expected_v[r, :, s : s + 2] = -k[r]
    assert torch.equal(cache.k[0], expected) and torch.equal(cache.v[0], expected_v)
    assert torch.equal(cache.k[1], before[1])  # other layers untouched


def test_crop_moves_lengths_only():
    cache = filled()
    k, v = cache.k.clone(), cache.v.clone()
    cache.crop(torch.tensor([0, 2, 2, 5]))
    assert cache.lengths.tolist() == [0, 2, 2, 5]
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


@pytest.mark.parametrize(
    "index",
    [[2, 0, 3, 1], [1, 0, 2, 3], [0, 1, 2, 3], [3, 3, 0, 0], [0, 0, 2, 2], [1, 1, 3, 0], [2, 0], [1], [0, 0, 1, 1, 2, 2],
     [1, 2, 3], [0, 2, 3], [0, 1, 2], [3, 1]],
    # kept roots: sources that stay in place are read where they are; mixed: some sources are overwritten;
    # a batch's rows that end: the rows after them move down, each over one already read
    ids=["permutation", "swap", "identity", "beams", "kept roots", "mixed", "fewer", "one", "more",
         "first ends", "second ends", "last ends", "two end"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["torch", "kernel"])  # float32: the C++ path
def test_reorder_gathers_rows(index, dtype):
    cache = filled(dtype=dtype)
    cache.k[:, :, :, cache.high :] = 7.0  # slots at and past `high` are never read; same-size reorders leave them
    k, v, lengths = cache.k.clone(), cache.v.clone(), cache.lengths.clone()
    k_storage = cache.k.untyped_storage().data_ptr()
    index = torch.tensor(index)
    cache.reorder(index)
    assert cache.rows == len(index) and cache.capacity >= CAP
    assert torch.equal(cache.k[:, :, :, : cache.high], k[:, index, :, : cache.high])
    assert torch.equal(cache.v[:, :, :, : cache.high], v[:, index, :, : cache.high])
    assert torch.equal(cache.lengths, lengths[index])
    if len(index) < ROWS:
        assert cache.k.untyped_storage().data_ptr() == k_storage
    if len(index) < ROWS and dtype == torch.float64:  # packed into the same storage, contiguous, zeroed from
        # `high` on as fresh storage is
        assert cache.k.is_contiguous() and cache.v.is_contiguous()
        assert (cache.k[:, :, :, cache.high :] == 0).all() and (cache.v[:, :, :, cache.high :] == 0).all()
    elif len(index) <= ROWS:  # the kernels': slots from `high` on are never touched (the first rows, as a view)
        assert (cache.k[:, :, :, cache.high :] == 7.0).all()
        assert cache.k.data_ptr() == k_storage and cache.k.stride() == k.stride()


def test_rows_that_end_one_by_one_leave_a_view_the_kernels_decode_on():
    """A batch's rows ending one after another, on the kernels' path: each drop is a view of the first rows
    of the same storage, and a write after it lands where the view's rows read it."""
    cache = filled(dtype=torch.float32)
    k = cache.k.clone()
    kept = list(range(ROWS))
    for gone in (1, 0, 1):
        index = [r for r in range(len(kept)) if r != gone]
        kept = [kept[r] for r in index]
        cache.reorder(torch.tensor(index))
        assert torch.equal(cache.k[:, :, :, : cache.high], k[:, kept, :, : cache.high])
    assert kept == [2] and cache.rows == 1
    new = torch.full((1, HEADS, 1, DIM), 5.0)
    keys, _ = cache.write(1, new, -new, 6)
    assert torch.equal(keys[:, :, :5], k[1, kept, :, :5]) and torch.equal(keys[:, :, 6:], new)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["torch", "kernel"])  # float32: the C++ path
def test_move_slots_copies_within_rows(dtype):
    """Slots src of the given rows land at dst in every layer and head, read before any write (dst of one
    entry is another's src), and nothing else changes."""
    cache = filled(dtype=dtype)
    k, v = cache.k.clone(), cache.v.clone()
    rows, src, dst = torch.tensor([2, 0]), torch.tensor([[4, 1], [3, 5]]), torch.tensor([[1, 2], [5, 3]])
    cache.move_slots(rows, src, dst)
    want_k, want_v = k.clone(), v.clone()
    for i, r in enumerate(rows.tolist()):
        for s, d in zip(src[i].tolist(), dst[i].tolist()):
            want_k[:, r, :, d], want_v[:, r, :, d] = k[:, r, :, s], v[:, r, :, s]
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)


def test_repeat_makes_consecutive_copies():
    cache = filled()
    k, lengths = cache.k.clone(), cache.lengths.clone()
    cache.repeat(3)
    assert cache.rows == 3 * ROWS
    for r in range(ROWS):
        for j in range(3):
            assert torch.equal(cache.k[:, 3 * r + j, :, :5], k[:, r, :, :5])
    assert cache.lengths.tolist() == lengths.repeat_interleave(3).tolist()


def test_grow_keeps_contents_and_at_least_doubles():
    cache = filled()
    k, v = cache.k.clone(), cache.v.clone()
    cache.grow(CAP)  # already fits: no-op
    assert cache.capacity == CAP and torch.equal(cache.k, k)
    cache.grow(CAP + 1)
    assert cache.capacity == 2 * CAP
    cache.grow(5 * CAP)
    assert cache.capacity == 8 * CAP  # doubled until it fits: capacities stay in power-of-two buckets
    assert torch.equal(cache.k[:, :, :, :5], k[:, :, :, :5]) and torch.equal(cache.v[:, :, :, :5], v[:, :, :, :5])
    keys, _ = cache.write(0, torch.ones(ROWS, HEADS, 1, DIM, dtype=torch.float64), v[0, :, :, :1], 30)
    assert keys.shape[2] == 31 and torch.equal(keys[:, :, :5], k[0, :, :, :5])


@pytest.mark.parametrize("change", ["grow", "fewer rows", "more rows"])
def test_writes_land_in_the_buffers_after_they_are_replaced(change):
    # grow and row-changing reorders allocate new K/V; each layer's write must go to the new ones
    cache = filled()
    if change == "grow":
        cache.grow(4 * CAP)
    else:
        cache.reorder(torch.tensor([2, 0] if change == "fewer rows" else [0, 1, 2, 3, 3, 1]))
    rows = cache.rows
    k = torch.full((rows, HEADS, 1, DIM), 3.0, dtype=torch.float64)
    for layer in range(LAYERS):
        keys, values = cache.write(layer, k, -k, 6)
        assert torch.equal(cache.k[layer, :, :, 6:7], k) and torch.equal(cache.v[layer, :, :, 6:7], -k)
        assert torch.equal(keys, cache.k[layer, :, :, :7]) and torch.equal(values, cache.v[layer, :, :, :7])
    ragged = torch.arange(rows) % 3
    cache.write(1, k, -k, ragged)
    assert all(torch.equal(cache.k[1, r, :, int(ragged[r])], k[r, :, 0]) for r in range(rows))


def test_by_reference_reorder_moves_table_entries_not_values():
    """A cache by reference: a reorder (and a dropped row) changes which storage each row reads, never the
    K/V; reads through the table equal a cache by value after the same steps; it cannot gain rows."""
    caches = [KVCache(LAYERS, ROWS, HEADS, DIM, CAP, dtype=torch.float64, device=torch.device("cpu"), by_reference=ref)
              for ref in (False, True)]
    g = torch.Generator().manual_seed(1)
    for t, index in enumerate([[1, 1, 3, 0], [2, 2, 0, 3], [0, 3, 1]]):  # the last drops a row
        k = torch.randn(caches[0].rows, HEADS, 1, DIM, generator=g, dtype=torch.float64)
        caches[1].claim(t, 1)
        for cache in caches:
            cache.write(0, k, -k, t)
        stored = caches[1].k.clone()
        for cache in caches:
            cache.reorder(torch.tensor(index))
        assert torch.equal(caches[1].k, stored)  # nothing moved
    k, v = torch.ones(3, HEADS, 1, DIM, dtype=torch.float64), torch.zeros(3, HEADS, 1, DIM, dtype=torch.float64)
    caches[1].claim(3, 1)
    outs = [cache.write(0, k, v, 3) for cache in caches]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert caches[1].rows == 3 and caches[1].k.shape[1] == ROWS  # storage rows stay put
    caches[1].grow(2 * CAP)
    assert caches[1].table.shape == (3, 2 * CAP)
    with pytest.raises(ValueError, match="gain rows"):
        caches[1].reorder(torch.tensor([0, 0, 1, 1, 2]))


def read(cache: KVCache, rows_lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What each row reads at its slots below its length (through its table where it has one)."""
    out = []
    for r, n in enumerate(rows_lengths):
        at = [r] * n if cache.table is None else cache.table[r, :n].tolist()
        out.append((torch.stack([cache.k[:, a, :, s] for s, a in enumerate(at)], 2),
                    torch.stack([cache.v[:, a, :, s] for s, a in enumerate(at)], 2)))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["torch", "kernel"])  # float32: the C++ path
def test_by_reference_speculative_beam_commits_read_as_by_value(dtype):
    """A speculative beam cycle's verbs on a cache by reference: items at different lengths t, a reorder
    within each item (new beams share their root's prefix), the accepted paths moved from tree slots to
    t+1.. (`move_slots`, from where each row's table points), new writes past each row's length, and a
    finished item's rows dropped while the others differ in length (copied by value: rows moving down
    must not write where other items' rows read). Every row reads what a cache by value holds."""
    layers, rows, cap = 2, 6, 16
    caches = [KVCache(layers, rows, HEADS, DIM, cap, dtype=dtype, device=torch.device("cpu"), by_reference=ref)
              for ref in (False, True)]
    g = torch.Generator().manual_seed(4)

    def write(start: torch.Tensor, n: int) -> None:
        for layer in range(layers):
            k = torch.randn(caches[0].rows, HEADS, n, DIM, generator=g, dtype=dtype)
            for cache in caches:
                cache.claim(start, n)
                cache.write(layer, k, -k, start)

    t = torch.tensor([3, 3, 5, 5, 4, 4])  # three items of two beams
    write(torch.zeros(rows, dtype=torch.long), 5)  # prefixes
    write(t, 4)  # each row's tree at t..t+3
    paths = torch.tensor([[2, 3], [1, 3], [1, 2], [3, 1], [2, 2], [3, 2]])  # rows sharing a root take other paths
    for cache in caches:
        cache.reorder(torch.tensor([1, 1, 2, 3, 5, 5]))  # within items
        cache.move_slots(torch.arange(rows), t[:, None] + paths, t[:, None] + torch.tensor([1, 2]))
        cache.crop(t + 3)
    lengths = (t + 3).tolist()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(read(caches[0], lengths), read(caches[1], lengths)))
    write(t + 3, 1)  # the next cycle's pending inputs
    for cache in caches:
        cache.reorder(torch.tensor([2, 3, 4, 5]))  # the first item done: rows move down
    lengths = (t[2:] + 4).tolist()
    write(t[2:] + 4, 1)  # row 2 (the third item, shorter) writes where the second item's rows read before
    lengths = (t[2:] + 5).tolist()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(read(caches[0], lengths), read(caches[1], lengths)))


def test_fitted_pool_hands_on_storage_of_finished_caches_only():
    """A pool with fit=True (the CPU backends') gives a new cache the front of a finished cache's storage,
    zeroed, for any shape that fits; never storage a live cache still uses, also as a view after it
    dropped rows; the storage a cache grew out of is handed on."""
    pool = BufferPool(3, fit=True)

    def new(rows, capacity):
        return KVCache(2, rows, 1, 4, capacity, dtype=torch.float32, device=torch.device("cpu"), pool=pool)

    first = new(3, 16)
    first.write(0, torch.ones(3, 1, 1, 4), 2 * torch.ones(3, 1, 1, 4), 0)
    address = first.k.data_ptr()
    first.reorder(torch.tensor([2]))  # one row left, in the front of the same storage
    assert first.k.data_ptr() == address and first.v[0, 0, 0, 0].eq(2).all()
    live = new(1, 16)  # the first is alive (as its packed view): fresh storage though its buffer is free of size
    assert live.k.data_ptr() != address
    del first
    smaller = new(2, 10)  # a smaller shape fits in the finished cache's storage, zeroed
    assert smaller.k.data_ptr() == address and smaller.k.is_contiguous()
    assert smaller.k.shape == (2, 2, 1, 10, 4) and not smaller.k.any() and not smaller.v.any()
    grown_from = live.k.data_ptr()
    live.grow(40)  # new storage; the old one is free again
    assert live.k.data_ptr() not in (grown_from, address)
    again = new(1, 16)
    assert again.k.data_ptr() == grown_from
