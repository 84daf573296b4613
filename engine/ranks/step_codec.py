"""A step's host metadata (positions, cache slots, query starts, context lengths,
block tables, a hybrid model's layer groups' slots and tables) and its copy-on-write
copies as int64 tensors and a few sizes, and back: how the step channel (tensor
parallel ranks) and the stage links (pipeline stages) send a step to another
process."""
from __future__ import annotations

import torch

from kvserve.engine.kernels.attention.step_metadata import HostStep

# T, R, W, C (copies), max_query_len, max_seq_len, decodes, G (sliding layer groups)
META_WORDS = 8


def encode(host: HostStep, copies: list[tuple[int, int, int]]
           ) -> tuple[list[int], list[torch.Tensor]]:
    """(the sizes, the tensors to concatenate) of a step."""
    flat_copies = torch.tensor(copies, dtype=torch.int64).reshape(-1)
    parts = [host.positions, host.slot_mapping, host.query_start_loc.long(),
             host.seq_lens.long(), host.block_tables.long().reshape(-1), flat_copies]
    for slots, tables in host.groups:  # as wide as the full group's (same blocks)
        parts += [slots, tables.long().reshape(-1)]
    r, w = host.block_tables.shape
    meta = [len(host.positions), r, w, len(copies), host.max_query_len, host.max_seq_len,
            host.num_decodes, len(host.groups)]
    return meta, parts


def sizes(meta: list[int]) -> list[int]:
    """How long each of encode's tensors is."""
    t, r, w, num_copies, _, _, _, num_groups = meta
    return [t, t, r + 1, r, r * w, 3 * num_copies] + [t, r * w] * num_groups


def decode(meta: list[int], parts: list[torch.Tensor], block_size: int
           ) -> tuple[HostStep, list[tuple[int, int, int]]]:
    """encode's tensors (split by sizes(meta), on the host) back into a step."""
    _, r, w, _, max_q, max_seq, decodes, _ = meta
    positions, slots, qsl, seq_lens, tables, copies, *groups = parts
    host = HostStep(positions, slots, qsl.int(), seq_lens.int(), tables.int().view(r, w),
                    max_q, max_seq, decodes, block_size,
                    tuple((s, t.int().view(r, w)) for s, t in zip(groups[::2], groups[1::2])))
    return host, [tuple(c) for c in copies.view(-1, 3).tolist()]
