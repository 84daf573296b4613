"""The prefix-aware prefill kernel against the torch reference: fresh prompts,
chunks starting mid-context (prefix-cache hits, chunked prefill), GQA 1/4/8 and
MQA, head dims 64/128, block sizes 16/32, fp32 and bf16, up to 2,000 tokens.

Outputs start as NaN and unowned cache slots hold NaN: a row the kernel does not
write, or a key it reads outside a request's context, shows up."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.attention.triton import prefill_attention
from tests.engine.attention.paged_batch import make_batch, needs_kernel_device, reference
from tests.engine.attention.tolerances import assert_close

pytestmark = needs_kernel_device

# (q_lens, seq_lens, q heads, kv heads, head_dim, block_size, dtype); decodes first.
CASES = {
    "fresh-mha": ([37, 64, 5], [37, 64, 5], 2, 2, 64, 16, torch.float32),
    "prefix-gqa4": ([1, 20, 70, 3], [9, 100, 70, 40], 8, 2, 128, 32, torch.float32),
    "chunks-gqa8-bf16": ([1, 1, 17, 33], [50, 3, 17, 81], 8, 1, 64, 16, torch.bfloat16),
    "mqa-bf16": ([65, 2], [130, 16], 4, 1, 128, 32, torch.bfloat16),
    "long-fresh": ([2000], [2000], 2, 1, 64, 16, torch.float32),
    "long-prefix-hit-bf16": ([1, 130], [1500, 1990], 8, 2, 128, 32, torch.bfloat16),
}


@pytest.mark.parametrize("case", CASES)
def test_prefill_kernel_matches_reference(case):
    q_lens, seq_lens, hq, hkv, head_dim, block_size, dtype = CASES[case]
    b = make_batch(q_lens, seq_lens, hq, hkv, head_dim, block_size, dtype,
                   seed=len(case)).with_new_tokens_cached()
    m = b.meta
    out = torch.full_like(b.q, float("nan"))
    prefill_attention(b.q, b.k_cache, b.v_cache, out, m.query_start_loc, m.seq_lens,
                      m.block_tables, b.scale, first_req=m.num_decodes,
                      num_reqs=m.num_prefills, max_query_len=m.max_query_len)
    nd = m.num_decodes
    assert out[:nd].isnan().all(), "the prefill kernel wrote rows of decodes"
    assert_close(out[nd:], reference(b)[nd:])


def test_single_token_spans_work_too():
    # A one-token chunk at the end of a long prompt takes the same path as a decode.
    b = make_batch([1, 1, 1], [1, 200, 64], 4, 2, 64, 16).with_new_tokens_cached()
    m = b.meta
    out = torch.full_like(b.q, float("nan"))
    prefill_attention(b.q, b.k_cache, b.v_cache, out, m.query_start_loc, m.seq_lens,
                      m.block_tables, b.scale, first_req=0, num_reqs=3, max_query_len=1)
    assert_close(out, reference(b))
