"""The runner's per-step metadata builder against a per-token loop."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.attention.step_metadata import build_host_step, pack_aligned, upload


def naive(starts, lens, tables, block_size):
    positions, slots = [], []
    for start, n, table in zip(starts, lens, tables):
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return positions, slots


def test_matches_a_per_token_loop():
    starts, lens = [5, 0, 31, 16, 0], [1, 1, 20, 17, 40]
    tables = [[7], [2], [0, 9, 4, 11], [3, 8, 13], [1, 5, 6]]
    host = build_host_step(starts, lens, tables, block_size=16)
    positions, slots = naive(starts, lens, tables, 16)
    assert host.positions.tolist() == positions
    assert host.slot_mapping.tolist() == slots
    assert host.query_start_loc.tolist() == [0, 1, 2, 22, 39, 79]
    assert host.seq_lens.tolist() == [6, 1, 51, 33, 40]
    assert host.block_tables.tolist()[0] == [7, 0, 0, 0]
    assert (host.max_query_len, host.max_seq_len, host.num_decodes) == (40, 51, 2)
    int32 = (host.query_start_loc, host.seq_lens, host.block_tables)
    assert all(t.dtype == torch.int32 for t in int32)
    assert host.slot_mapping.dtype == torch.int64


def test_to_device_fills_the_common_metadata():
    host = build_host_step([3, 0], [1, 4], [[1], [0]], block_size=16)
    positions, meta, (extra,) = host.to_device(torch.device("cpu"), [torch.arange(3)])
    assert positions.tolist() == [3, 0, 1, 2, 3]
    assert (meta.num_decodes, meta.num_prefills, meta.num_tokens) == (1, 1, 5)
    assert meta.slot_mapping.tolist() == [19, 0, 1, 2, 3]
    assert extra.tolist() == [0, 1, 2]


def test_decodes_must_come_first():
    with pytest.raises(ValueError, match="first"):
        build_host_step([0, 3], [4, 1], [[0], [1]], block_size=16)


def test_upload_on_cpu_moves_nothing():
    t = torch.arange(4)
    assert upload([t], torch.device("cpu"))[0] is t


def test_uploaded_pieces_start_16_byte_aligned():
    """Pieces packed for one transfer each start on 16 bytes whatever the lengths
    before them: Triton compiles a kernel per pointer alignment, so an unaligned
    block table (after 3 int32 lengths, say) would be a compile of its own."""
    int32 = [torch.arange(3, dtype=torch.int32), torch.arange(6, dtype=torch.int32).view(2, 3),
             torch.arange(5, dtype=torch.int32)]
    buf, starts = pack_aligned(int32, pin=False)
    assert starts == [0, 4, 12]
    for t, start in zip(int32, starts):
        assert torch.equal(buf[start:start + t.numel()].view(t.shape), t)
    moved = upload([torch.zeros(3, dtype=torch.long), *int32], torch.device("meta"))
    assert [tuple(m.shape) for m in moved] == [(3,), (3,), (2, 3), (5,)]
    assert all(m.storage_offset() * m.element_size() % 16 == 0 for m in moved)
