"""bench/triton_aot_check.py here, without a GPU: every Triton kernel under engine/
compiled for sm_90 and sm_80 in every variant the backends launch (block sizes 16 and
32 on sm_90, 16 on sm_80), each within its target's limits, each compiled once
whatever the step, and no @triton.jit function left out. On a cold Triton cache: about 60 s on 2 cores."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.triton_aot_check import describe, main, uncovered

pytest.importorskip("triton")

KERNELS = {"_store_kv_kernel", "_decode_split_kernel", "_merge_kernel", "_prefill_kernel",
           "_latent_decode_kernel", "_latent_prefill_kernel",
           "_gate_up_kernel", "_down_kernel",
           "_shrink", "_expand"}


# sm_90 (the H100/H200 a session is lent) in both block sizes; sm_80 (A100) in the
# default one only, which keeps the suite's share of compiles down (a third fewer).
# bf16 and fp32 only (fp16 launches bf16's tiles, elements of the same size; fp32
# has tiles of its own, the ones that spilled): a third fewer again.
# `python bench/triton_aot_check.py` checks every target, block size and dtype.
RUNS = (("90", "16,32"), ("80", "16"))
DTYPES = "bfloat16,float32"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The check's exit status and JSON (RUNS' variants together), on a cold Triton
    cache of its own."""
    statuses, variants, uncovered = [], [], None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        for targets, block_sizes in RUNS:
            out = tmp_path_factory.mktemp("aot") / "aot.json"
            statuses.append(main(["--targets", targets, "--block-sizes", block_sizes,
                                  "--one-per-variant", "--dtypes", DTYPES, "--json", str(out)]))
            result = json.loads(out.read_text())
            variants += result["variants"]
            # (left out only if no run launched it)
            left = set(result["meta"]["uncovered"])
            uncovered = left if uncovered is None else uncovered & left
    return max(statuses), {"variants": variants, "meta": {"uncovered": sorted(uncovered)}}


def test_every_variant_compiles_and_fits_its_target(report):
    """At most 255 registers, no spills, shared memory within the block's limit, a
    block per SM: fp32 and fp8-cache variants too (they spilled before the kernels'
    tiles were chosen by this check)."""
    status, result = report
    compiled = [(v, s) for v in result["variants"] for s in v["specialisations"]]
    assert compiled and all(len(v["specialisations"]) == 1 for v in result["variants"])
    assert [describe(v) + ": " + s["error"] for v, s in compiled if "error" in s] == []
    assert {describe(v): s["problems"] for v, s in compiled if s["problems"]} == {}
    assert status == 0


def test_each_variant_compiles_once_whatever_the_step(report):
    """No argument that changes from step to step (split counts, table widths, the
    first prompt's row, pointers into the step's packed metadata) specialises a
    kernel: each variant is one compile on the GPU, at start-up or capture, never a
    JIT compile mid-serving (this was 2,118 compiles for 420 variants)."""
    _, result = report
    assert {describe(v): v["recorded"] for v in result["variants"] if v["recorded"] != 1} == {}


def test_kernels_indexing_by_token_or_request_widen_it_to_int64(report):
    """A token's or request's row offset passes 2**31 elements at real sizes (16k
    tokens of a 128k-wide LoRA output): the kernels whose first grid axis walks
    tokens or requests widen its program id to int64 before any product."""
    _, result = report
    narrow = {describe(v) for v in result["variants"]
              for s in v["specialisations"] if "x" not in s["wide_program_ids"]
              and v["kernel"] in {"_shrink", "_expand", "_store_kv_kernel",
                                  "_decode_split_kernel", "_merge_kernel"}}
    assert narrow == set()


def test_both_targets_and_every_kernel_are_checked(report):
    _, result = report
    seen = {(g["target"], g["kernel"]) for g in result["variants"]}
    assert seen == {(t, k) for t in ("sm_90", "sm_80") for k in KERNELS}
    assert result["meta"]["uncovered"] == []


def test_the_launches_recorded_are_the_gpus(report):
    """No interpreter-only path (fp32 upcasts, the store's e4m3 rounding by hand), and
    an fp8 cache only where the backend allows one (capability 8.9 and up)."""
    _, result = report
    for g in result["variants"]:
        assert g["constexprs"].get("UPCAST", False) is False
        assert g["constexprs"].get("INTERPRETED", False) is False
    fp8 = {g["target"] for g in result["variants"] if "*fp8e4nv" in g["pointers"].values()}
    assert fp8 == {"sm_90"}


def test_a_jit_function_no_kernel_reaches_is_reported():
    """uncovered: launched kernels and what they call count; the rest is reported."""
    launched = [SimpleNamespace(module="kvserve.engine.kernels.attention.triton.decode",
                                name="_decode_split_kernel")]
    missing = uncovered(launched)
    assert "kvserve.engine.kernels.attention.triton.paged_tile.attend_paged" not in missing
    assert "kvserve.engine.kernels.lora.triton_kernels._shrink" in missing
    assert "kvserve.engine.kernels.attention.triton.store._round_to_e4m3" in missing
