"""The split-K decode kernel and its log-sum-exp merge against the torch reference:
one split and many (partitions shorter than some contexts, longer than others),
GQA packing at ratios 1, 4 and 8 and MQA, head dims 64/128, block sizes 16/32,
fp32 and bf16, contexts up to 2,000 tokens."""
from __future__ import annotations

import pytest
import torch

from engine.attention.triton import decode_attention, plan_partition
from engine.attention.triton import decode
from engine.attention.triton.decode import BLOCK_N, MIN_PARTITION
from tests.engine.attention.paged_batch import (DEVICE, make_batch, needs_kernel_device,
                                               reference)
from tests.engine.attention.tolerances import assert_close

pytestmark = needs_kernel_device

# (seq_lens, q heads, kv heads, head_dim, block_size, dtype, keys per split or None)
CASES = {
    "mha-many-splits": ([1, 17, 300, 64], 4, 4, 64, 16, torch.float32, 64),
    "gqa4-long-planned": ([2000, 5, 777], 8, 2, 128, 32, torch.float32, None),
    "gqa4-long-split": ([2000, 5, 777], 8, 2, 128, 32, torch.float32, 256),
    "gqa8-bf16": ([1500, 64, 65, 1], 8, 1, 128, 16, torch.bfloat16, 128),
    "mqa-bf16": ([33, 1024], 4, 1, 64, 32, torch.bfloat16, None),
    "gqa3-odd-dims": ([100, 7], 6, 2, 24, 16, torch.float32, 64),
}


@pytest.mark.parametrize("case", CASES)
def test_decode_kernel_matches_reference(case):
    seq_lens, hq, hkv, head_dim, block_size, dtype, partition = CASES[case]
    b = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, head_dim, block_size, dtype,
                   seed=len(case)).with_new_tokens_cached()
    m = b.meta
    out = torch.full_like(b.q, float("nan"))
    decode_attention(b.q, b.k_cache, b.v_cache, out, m.seq_lens, m.block_tables, b.scale,
                     m.max_seq_len, partition_size=partition)
    assert_close(out, reference(b))


def test_decode_writes_only_its_rows():
    b = make_batch([1, 1], [40, 90], 4, 1, 64, 16).with_new_tokens_cached()
    m = b.meta
    out = torch.full((4, 4, 64), float("nan"), device=DEVICE)
    decode_attention(b.q, b.k_cache, b.v_cache, out[:2], m.seq_lens, m.block_tables, b.scale,
                     m.max_seq_len, partition_size=64)
    assert_close(out[:2], reference(b))
    assert out[2:].isnan().all()


@pytest.mark.parametrize("reqs,kv_heads,max_len,splits", [
    (1, 1, 10, 1),  # too short to split
    (1, 8, 4000, 16),  # few programs: split down to MIN_PARTITION keys
    (4, 2, 70000, 33),  # about two programs per SM
    (256, 8, 3000, 1),  # the batch alone fills the GPU
])
def test_partition_plan_on_a_132_sm_gpu(monkeypatch, reqs, kv_heads, max_len, splits):
    monkeypatch.setattr(decode, "parallelism", lambda device: 132)
    part = plan_partition(reqs, kv_heads, max_len, torch.device("cuda"))
    assert part % BLOCK_N == 0
    assert -(-max_len // part) == splits
    assert splits == 1 or part >= MIN_PARTITION
