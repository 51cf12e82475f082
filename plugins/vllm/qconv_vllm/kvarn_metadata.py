"""KVarN's per-step metadata, from vLLM's CPU-side copies only: which staging slot each running sequence holds
(`SlotTable`) and the ints the Triton attention reads (exact-run positions and starts, seq_lens, query_start),
copied to the device once per step. Imports neither vLLM nor Triton (the backend's builder and the tests use it)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class SlotTable:
    """Which staging slot each running sequence holds, keyed by its first block id (unique among live sequences;
    prefix caching, which would share it, is refused). vLLM does not tell a backend when a request ends, so slots
    are recycled least-recently-used among keys absent from the batch; capacity leaves room for every sequence
    the scheduler can hold twice over, so a live sequence is never evicted in practice, and if one were, its
    fp16 tokens are zeroed and counted in `lost` instead of being read from another sequence."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.owner: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))
        self.written = [0] * capacity  # tokens written to each slot up to the last step (rollback detection)
        self.lost = 0

    def assign(self, key: int, start: int, in_batch: set[int]) -> tuple[int, bool]:
        """(slot, fresh): fresh when the slot's exact tiles must be cleared before use."""
        if key in self.owner:
            self.owner.move_to_end(key)
            return self.owner[key], False
        if not self.free:
            old = next((k for k in self.owner if k not in in_batch), None)
            if old is None:
                raise RuntimeError(f"KVarN: more than {self.capacity} sequences in one batch")
            self.free.append(self.owner.pop(old))
        slot = self.free.pop()
        self.owner[key] = slot
        if start > 0:
            self.lost += 1
            log.warning("KVarN: a running sequence lost its fp16 tiles (slot recycled); %d so far", self.lost)
        return slot, True


@dataclass
class KVarNMetadata:
    num_actual_tokens: int
    query_start: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, max_tiles] kernel block (tile) ids
    slots: list[int]
    fresh: list[bool]
    written_before: list[int]  # tokens the slot held written before this step (> start: speculative rollback)
    capacity: int
    ints: torch.Tensor  # on the device: exact-run positions [E], exact-run starts, seq_lens, query_start
    n_exact: int  # E


def exact_positions(query_start: list[int], seq_lens: list[int], tile: int) -> tuple[list[int], list[int]]:
    """Positions of each request's exact run (what the Triton attention may read in fp16): the sink, then the
    tokens `_write` returns (from the first tile still open when the step's first query past the sink came in
    to the end), and the run starts [num_reqs + 1]. From host lists only: the same for every layer."""
    pos, starts = [], [0]
    for i, end in enumerate(seq_lens):
        start = end - (query_start[i + 1] - query_start[i])
        pos.extend(range(min(end, tile)))
        p0 = start + max(0, min(end, tile) - start)
        if p0 < end:
            pos.extend(range(p0 // tile * tile, end))
        starts.append(len(pos))
    return pos, starts


def host_lists(cam, exact_cpu_lens: bool) -> tuple[list[int], list[int], list[int]]:
    """(query_start, seq_lens, slot keys) of vLLM's CommonAttentionMetadata from its CPU-side copies. Two reads of
    the device remain, once a step: seq_lens when the CPU copy is only an upper bound (`exact_cpu_lens` False:
    async scheduling with speculative decoding) or absent, and the block table's first column as the key where
    vLLM gives no `req_idx` (its v1 runner)."""
    n = cam.num_reqs
    qs = cam.query_start_loc_cpu[: n + 1].tolist()
    cpu_lens = cam.seq_lens_cpu_upper_bound
    lens = (cpu_lens if cpu_lens is not None and exact_cpu_lens else cam.seq_lens)[:n].tolist()
    keys = cam.req_idx[:n].tolist() if cam.req_idx is not None else cam.block_table_tensor[:n, 0].tolist()
    return qs, lens, keys


def step_metadata(
    table: SlotTable, query_start: list[int], seq_lens: list[int], keys: list[int], block_table, tile: int
) -> KVarNMetadata:
    """One step's metadata from host lists (vLLM's CPU-side copies): staging slots, and one host-to-device copy
    of the ints the attention kernel reads, from pinned memory without waiting for the device."""
    in_batch = set(keys)
    slots, fresh, before = [], [], []
    for i, key in enumerate(keys):
        start = seq_lens[i] - (query_start[i + 1] - query_start[i])
        slot, new = table.assign(key, start, in_batch)
        slots.append(slot)
        fresh.append(new or start == 0)
        before.append(0 if new else table.written[slot])
        table.written[slot] = seq_lens[i]
    pos, starts = exact_positions(query_start, seq_lens, tile)
    ints = torch.tensor([*pos, *starts, *seq_lens, *query_start], dtype=torch.int32)
    if block_table.is_cuda:
        ints = ints.pin_memory()
    return KVarNMetadata(
        query_start[-1],
        query_start,
        seq_lens,
        block_table,
        slots,
        fresh,
        before,
        table.capacity,
        ints.to(block_table.device, non_blocking=True),
        len(pos),
    )


def slot_capacity(max_num_seqs: int) -> int:
    """Staging slots: every sequence the scheduler can hold, twice over (see SlotTable)."""
    return 2 * max_num_seqs + 8
