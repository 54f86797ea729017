"""Self-attention KV cache: preallocated K/V for every decoder layer, committed length per row.

Rows are independent sequences (batch items, beams, CFG halves). Positions beyond a row's committed
length may hold stale K/V from rejected drafts; the decoder never attends past a query's own position,
so rollback is only a length change (`crop`) and the stale slots are overwritten by the next write.

By reference (`by_reference=True`, beam search): a slot table (rows, capacity) says which storage row
each row reads each slot from, so `reorder` moves table entries instead of K/V (beams share their common
prefix's storage, and a beam step copies nothing). Writes always go to the row's own storage, so this is
exact only while no slot that another row still reads is written again: true when every row writes each
slot once, in step (plain beam search), and when rows write only past the length their item had when
its beams last shared slots (speculative beam search: a cycle's tree and accepted path lie past the item's
length t, the slots its beams share below it). Rows dropped while rows differ in length (`crop`) are
copied by value: the rows that move down would otherwise write where other items' rows read.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor

from . import kernels


class KVCache:
    """K/V of shape (layers, rows, kv_heads, capacity, dim_head); only the verbs below mutate it."""

    def __init__(
        self,
        layers: int,
        rows: int,
        kv_heads: int,
        dim_head: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        by_reference: bool = False,
        pool: BufferPool | None = None,
    ) -> None:
        """pool: where K/V storage comes from (buffers of caches that are gone) instead of new tensors."""
        self.pool = pool
        self.k, self.v = self._new((layers, rows, kv_heads, capacity, dim_head), dtype, device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.high = 0  # one past the highest position ever written: bounds reorder copies
        # by reference: the storage row each row reads each slot from (see the module docstring)
        self.table = self._own(rows, capacity) if by_reference else None
        self._per_layer()

    @property
    def rows(self) -> int:
        return self.k.shape[1] if self.table is None else self.table.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    # ---- verbs -------------------------------------------------------------------------------

    def write(self, layer: int, k: Tensor, v: Tensor, start: int | Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (rows, kv_heads, n, dim_head) at positions start.. of each row.

        `start` is an int when every row writes at the same position (the common, fast case) or a
        LongTensor (rows,) for ragged rows. Returns this layer's K/V up to the furthest written
        position, ready for attention.
        """
        n, rows = k.shape[2], k.shape[0]
        k_layer, v_layer = self._k_layers[layer], self._v_layers[layer]
        if isinstance(start, int):
            end = start + n
            k_layer[:rows, :, start:end] = k
            v_layer[:rows, :, start:end] = v
        else:
            end = int(start.max()) + n
            pos = start[:, None] + torch.arange(n, device=start.device)  # (rows, n)
            row = torch.arange(rows, device=start.device)[:, None].expand_as(pos)
            k_layer[row, :, pos] = k.transpose(1, 2)
            v_layer[row, :, pos] = v.transpose(1, 2)
        self.high = max(self.high, end)
        if self.table is not None:  # each slot from the row the table names: (rows, kv_heads, end, d)
            table = self.table[:, :end]
            slot = torch.arange(end, device=table.device)
            return k_layer[table, :, slot].transpose(1, 2), v_layer[table, :, slot].transpose(1, 2)
        return k_layer[:, :, :end], v_layer[:, :, :end]

    def claim(self, start: int | Tensor, n: int) -> None:
        """By reference: rows are about to write slots start..start+n-1 and read them from their own
        storage from now on (a no-op for a cache without a table)."""
        if self.table is None:
            return
        own = torch.arange(self.rows, device=self.table.device)[:, None]
        if isinstance(start, int):
            self.table[:, start : start + n] = own
        else:
            slots = start[:, None] + torch.arange(n, device=start.device)
            self.table.scatter_(1, slots, own.expand_as(slots))

    def buffers(self, end: int) -> tuple[Tensor, Tensor]:
        """The whole K and V buffers (layers, rows, kv_heads, capacity, dim_head), for a kernel that
        writes slots below `end` itself (`kernels.Stack.run`)."""
        if end > self.capacity:
            raise ValueError(f"end {end} exceeds the cache capacity {self.capacity}")
        self.high = max(self.high, end)
        return self.k, self.v

    def crop(self, lengths: Tensor) -> None:
        """Set each row's committed length (rollback or commit); no tensor is rebuilt."""
        self.lengths = lengths.to(self.lengths)

    def reorder(self, index: Tensor) -> None:
        """Rows become `index` of the old rows (beam reordering, dropping finished rows)."""
        high = self.high
        if self.table is not None:
            if index.numel() > self.k.shape[1]:
                raise ValueError("a cache by reference cannot gain rows")
            if index.numel() < self.rows and not bool((self.lengths == self.lengths[0]).all()):
                self._resolve(index, high)  # rows at different lengths: by value (module docstring)
            else:
                self.table = self.table[index]  # beams share storage; nothing is copied
        elif index.numel() <= self.rows and kernels.available(self.k.device, self.k.dtype):
            # one call instead of ~8 indexing kernels, copying only the rows that move. Fewer rows (a batch's
            # rows that ended): the first rows of the same storage, as a view (the kernels take its strides);
            # their slots from `high` on were never written, so still zero. Packed into a new contiguous
            # layout instead, every slot of every layer moved and the rest zeroed: ~1.2 ms a dropped row on
            # the shipped model at batch 8, 9% of its greedy decoding there
            kernels.reorder_rows(self.k, index, high)
            kernels.reorder_rows(self.v, index, high)
            if index.numel() < self.rows:
                self.k, self.v = self.k[:, : index.numel()], self.v[:, : index.numel()]
                self._per_layer()
        elif index.numel() == self.rows or (self.pool is not None and not self.pool.fit and index.numel() < self.rows):
            # every row gathered into the first rows of the same storage, the right-hand side before
            # writing (finding the rows that moved would read the index back: on a GPU, a wait every beam
            # step). Fewer rows: the pool's caches keep their storage and its address as a view; what
            # lies past `high` in those rows is other rows' finite K/V, never attended with a nonzero weight
            n = index.numel()
            self.k[:, :n, :, :high] = self.k[:, index, :, :high]
            self.v[:, :n, :, :high] = self.v[:, index, :, :high]
            if n < self.rows:
                self.k, self.v = self.k[:, :n], self.v[:, :n]
                self._per_layer()
        elif index.numel() < self.rows and self.k.is_contiguous() and self.v.is_contiguous():
            # fewer rows: packed into the front of the same storage, still contiguous. Fresh storage of
            # the smaller shape cost more than the copy: on the CPU, zeroing new pages (0.6 ms each for the
            # shipped model's 4-row K, ~10% of a plain batch-4 call, one per row that ends)
            self.k, self.v = (self._packed(t, index, high) for t in (self.k, self.v))
            self._per_layer()
        else:
            old = self.k, self.v
            self.k, self.v = self._new((old[0].shape[0], index.numel(), *old[0].shape[2:]), old[0].dtype, old[0].device)
            for new, before in zip((self.k, self.v), old):
                new[:, :, :, :high] = before[:, index, :, :high]
            self._per_layer()
        self.lengths = self.lengths[index]

    def move_slots(self, rows: Tensor, src: Tensor, dst: Tensor) -> None:
        """Within each row, copy K/V (all layers) from slots src (rows, s) to slots dst (rows, s).

        Sources are gathered before anything is written, so overlapping src and dst are safe. By
        reference: the K/V each row reads at src (wherever its table points) land in its own storage at
        dst, which it reads from then on (no other row may read those slots of its storage: module
        docstring).
        """
        if self.k.is_contiguous() and self.v.is_contiguous() and kernels.available(self.k.device, self.k.dtype):
            kernels.move_slots([self.k, self.v], rows, src, dst, self.table)  # one call, not ~10 indexing kernels
            return
        r = rows[:, None].expand_as(src)
        source = r if self.table is None else self.table[r, src]  # storage row of each source slot
        self.k[:, r, :, dst] = self.k[:, source, :, src]
        self.v[:, r, :, dst] = self.v[:, source, :, src]
        if self.table is not None:
            self.table[r, dst] = r

    def repeat(self, n: int) -> None:
        """Each row becomes n consecutive copies of itself (one per beam)."""
        self.reorder(torch.arange(self.rows, device=self.lengths.device).repeat_interleave(n))

    def grow(self, capacity: int) -> None:
        """Make room for at least `capacity` positions (keeps contents)."""
        if capacity <= self.capacity:
            return
        grown = 2 * self.capacity
        while grown < capacity:  # doubling: a capacity of power-of-two buckets stays in them
            grown *= 2
        capacity = grown
        old = self.k, self.v
        self.k, self.v = self._new((*old[0].shape[:3], capacity, old[0].shape[4]), old[0].dtype, old[0].device)
        for new, before in zip((self.k, self.v), old):
            new[:, :, :, : self.high] = before[:, :, :, : self.high]
        if self.table is not None:  # slots not yet written: each row's own (until written, never read)
            table = self._own(self.table.shape[0], capacity)
            table[:, : self.high] = self.table[:, : self.high]
            self.table = table
        self._per_layer()

    # ---- helpers -------------------------------------------------------------------------------

    def _resolve(self, index: Tensor, high: int) -> None:
        """By reference: rows become `index` of the old rows by value (each slot below `high` copied from
        where its table points into the new row's own storage), and read their own storage again."""
        n = index.numel()
        table = self.table[index, :high]  # (n, high) storage row of each slot
        slot = torch.arange(high, device=table.device)
        for layer in (*self._k_layers, *self._v_layers):  # per layer: gathered before written
            layer[:n, :, :high] = layer[table, :, slot].transpose(1, 2)
        self.table = self._own(n, self.capacity)

    def _per_layer(self) -> None:
        # each layer's view, made once per buffer: indexing self.k[layer] on every write costs two
        # small ops per layer and step (host time per op is what a GPU decode step is bound by)
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)

    @staticmethod
    def _packed(t: Tensor, index: Tensor, high: int) -> Tensor:
        """Rows `index` of the contiguous buffer t, slots below `high`, as a contiguous buffer at the
        front of t's storage; slots from `high` on are zeroed, as in fresh storage."""
        gathered = t[:, index, :, :high]  # a copy: read before anything is written
        shape = (t.shape[0], index.numel(), *t.shape[2:])
        packed = t.as_strided(shape, torch.empty(shape, device="meta").stride(), t.storage_offset())
        packed[:, :, :, :high] = gathered
        packed[:, :, :, high:] = 0
        return packed

    def _own(self, rows: int, capacity: int) -> Tensor:
        return torch.arange(rows, device=self.lengths.device)[:, None].repeat(1, capacity)

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """Zeroed K and V storage of `shape`."""
        if self.pool is not None:
            return self.pool.take(shape, dtype, device, self)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class BufferPool:
    """K/V storage handed on from caches that are gone, or that moved to other storage (grown), to new
    storage requests (the most recent `shapes` buffers are kept).

    By shape (the default): a request gets the last storage of its exact shape, and a pooled cache that
    drops rows keeps its storage (`KVCache.reorder`): a captured CUDA graph reads the cache at a fixed
    address, and fresh storage for every decode would make each graph record again.
    fit=True: a request gets the smallest free buffer with room for it, as a contiguous view of its front.
    On the CPU fresh storage costs its page faults: zeroing a new 16 MB cache took 4-14 ms (1-4 GB/s),
    zeroing the same bytes again about 1 ms; at width 512 that was 3-5% of a speculative beam search call.
    One decode at a time per pool, as per decoder (its counters and auto's tables are not shared safely either)."""

    def __init__(self, shapes: int = 8, fit: bool = False) -> None:
        self.shapes, self.fit = shapes, fit
        self._held: dict[tuple, tuple[Tensor, Tensor, weakref.ref]] = {}

    @staticmethod
    def _free(held: tuple[Tensor, Tensor, weakref.ref]) -> bool:
        cache = held[2]()
        if cache is not None and _same_storage(cache.k, held[0]):  # still in use (maybe as a view)
            return False
        return not held[0].is_inference() or torch.is_inference_mode_enabled()  # inference tensors: only there

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, owner: KVCache
             ) -> tuple[Tensor, Tensor]:
        """Zeroed K and V of `shape` for `owner`: held storage that no live cache uses, else new."""
        if self.fit:
            return self._fitted(tuple(shape), dtype, torch.device(device), owner)
        key = (tuple(shape), dtype, torch.device(device))
        held = self._held.pop(key, None)
        if held is not None and not self._free(held):
            held = None
        if held is None:
            k, v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        else:
            k, v = held[0].zero_(), held[1].zero_()  # stale K/V are masked, but NaN * a zero weight is NaN
        self._hold(key, k, v, owner)
        return k, v

    def _fitted(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, owner: KVCache
                ) -> tuple[Tensor, Tensor]:
        need = math.prod(shape)
        fits = [key for key, held in self._held.items()
                if key[1:] == (dtype, device) and held[0].numel() >= need and self._free(held)]
        if fits:
            key = min(fits, key=lambda f: self._held[f][0].numel())
            k_flat, v_flat, _ = self._held.pop(key)
        else:
            key = (object(), dtype, device)  # a buffer of its own (flat: any shape views its front)
            k_flat, v_flat = (torch.empty(need, dtype=dtype, device=device) for _ in range(2))
        self._hold(key, k_flat, v_flat, owner)
        return k_flat[:need].view(shape).zero_(), v_flat[:need].view(shape).zero_()

    def _hold(self, key: tuple, k: Tensor, v: Tensor, owner: KVCache) -> None:
        """Keep k, v as the most recently taken, `owner`'s while it uses them; the least recently taken go."""
        self._held[key] = (k, v, weakref.ref(owner))
        while len(self._held) > self.shapes:
            del self._held[next(iter(self._held))]
