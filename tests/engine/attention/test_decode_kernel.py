"""The split-K decode kernel and its log-sum-exp merge against the torch reference:
one split and many (each request dividing its own context among the splits, so
some fill them all and some one; splits planned for a far longer context, as in a
CUDA graph captured for the model's limit),
GQA packing at ratios 1, 4 and 8 and MQA, head dims 64/128, block sizes 16/32,
fp32 and bf16, contexts up to 2,000 tokens."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.attention.triton import decode_attention, plan_splits
from kvserve.engine.kernels.attention.triton import decode
from kvserve.engine.kernels.attention.triton.decode import MAX_SPLITS
from tests.engine.attention.paged_batch import (DEVICE, make_batch, needs_kernel_device,
                                               reference)
from tests.engine.attention.tolerances import assert_close

pytestmark = needs_kernel_device

# (seq_lens, q heads, kv heads, head_dim, block_size, dtype,
#  (splits, fewest keys per split) or None for the plan)
CASES = {
    "mha-many-splits": ([1, 17, 300, 64], 4, 4, 64, 16, torch.float32, (8, 64)),
    "gqa4-long-planned": ([2000, 5, 777], 8, 2, 128, 32, torch.float32, None),
    "gqa4-long-split": ([2000, 5, 777], 8, 2, 128, 32, torch.float32, (8, 256)),
    "gqa8-bf16": ([1500, 64, 65, 1], 8, 1, 128, 16, torch.bfloat16, (12, 128)),
    "mqa-bf16": ([33, 1024], 4, 1, 64, 32, torch.bfloat16, None),
    "gqa3-odd-dims": ([100, 7], 6, 2, 24, 16, torch.float32, (8, 64)),
    # 33 splits, as planned for one request at a 128k limit on a 132-SM GPU: the
    # 1,000-key context fills 16 of them, the 40-key one the first alone.
    "planned-for-128k": ([1000, 40, 3000], 8, 2, 64, 16, torch.float32, (33, 64)),
}


@pytest.mark.parametrize("case", CASES)
def test_decode_kernel_matches_reference(case):
    seq_lens, hq, hkv, head_dim, block_size, dtype, plan = CASES[case]
    b = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, head_dim, block_size, dtype,
                   seed=len(case)).with_new_tokens_cached()
    m = b.meta
    out = torch.full_like(b.q, float("nan"))
    splits, fewest = plan or (None, decode.MIN_PARTITION)
    decode_attention(b.q, b.k_cache, b.v_cache, out, m.seq_lens, m.block_tables, b.scale,
                     m.max_seq_len, num_splits=splits, min_partition=fewest)
    assert_close(out, reference(b))


def test_decode_writes_only_its_rows():
    b = make_batch([1, 1], [40, 90], 4, 1, 64, 16).with_new_tokens_cached()
    m = b.meta
    out = torch.full((4, 4, 64), float("nan"), device=DEVICE)
    decode_attention(b.q, b.k_cache, b.v_cache, out[:2], m.seq_lens, m.block_tables, b.scale,
                     m.max_seq_len, num_splits=4, min_partition=64)
    assert_close(out[:2], reference(b))
    assert out[2:].isnan().all()


@pytest.mark.parametrize("reqs,kv_heads,max_len,splits", [
    (1, 1, 10, 1),  # too short to split
    (1, 8, 4000, 16),  # few programs: no split under MIN_PARTITION keys
    (4, 2, 70000, 33),  # about two programs per SM
    (1, 8, 131072, 33),  # a batch-1 graph captured at a 128k limit: as many, not 1
    (1, 1, 10**6, MAX_SPLITS),
    (256, 8, 3000, 1),  # the batch alone fills the GPU
])
def test_split_plan_on_a_132_sm_gpu(monkeypatch, reqs, kv_heads, max_len, splits):
    monkeypatch.setattr(decode, "parallelism", lambda device: 132)
    assert plan_splits(reqs, kv_heads, max_len, torch.device("cuda")) == splits
