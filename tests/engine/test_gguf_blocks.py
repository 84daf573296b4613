"""GGUF's quantized types split into integers and group scales (gguf_blocks.py):
for every kept type, synthetic blocks written by gguf's own writer and read back
give, as q * scale (+ min) in float32, exactly what gguf.quants.dequantize gives;
shards of different types stacked into one layer keep every value."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from kvserve.engine.platform.gguf_blocks import DECODERS, GroupQuant, concat_rows, decode
from tests.support.tiny_gguf import synthetic_blocks

T = gguf.GGMLQuantizationType
ROWS, COLS = 6, 512


def _values(blocks: GroupQuant) -> np.ndarray:
    """w = v * scale (+ min) in float32, as the layers compute it: v the codebook's
    value at q or q, each group value its factor times its super-block's."""
    def per_group(fine, base):
        values = fine.astype(np.float32)
        if base is not None:
            values = values * np.repeat(base.astype(np.float32),
                                        values.shape[1] // base.shape[1], axis=1)
        return values[..., None]

    n, k = blocks.q.shape
    v = blocks.q if blocks.codebook is None else blocks.codebook[blocks.q]
    w = v.astype(np.float32).reshape(n, -1, blocks.group) \
        * per_group(blocks.scales, blocks.scale_base)
    if blocks.mins is not None:
        w = w + per_group(blocks.mins, blocks.min_base)
    return w.reshape(n, k)


def _blocks(kind: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "MXFP4":  # a byte of exponent, then nibbles: exponents of weights' size
        rows = synthetic_blocks("Q4_0", ROWS, COLS, rng).reshape(ROWS, -1, 18)[..., 1:]
        rows[..., 0] = rng.integers(115, 125, rows.shape[:2])
        return np.ascontiguousarray(rows).reshape(ROWS, -1)
    return synthetic_blocks(kind, ROWS, COLS, rng)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every kept type's synthetic tensor through a GGUF file and back."""
    path = tmp_path_factory.mktemp("blocks") / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for kind in DECODERS:
        writer.add_tensor(kind, _blocks(kind), raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_every_kept_type_is_its_integers_times_its_scales(written, kind):
    tensor = written[kind]
    assert tensor.tensor_type == T[kind]
    rows = np.asarray(tensor.data)
    blocks = decode(kind, rows)
    expected = dequantize(rows, T[kind])
    assert blocks.q.shape == expected.shape == (ROWS, COLS)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    assert np.array_equal(_values(blocks), expected)
    assert blocks.lo <= blocks.q.min() and blocks.q.max() <= blocks.hi
    if blocks.fits_int4():  # the int4 layer's form: 0..15 with minimums, same values
        shifted = blocks.shifted()
        assert 0 <= shifted.q.min() and shifted.q.max() <= 15
        assert np.array_equal(_values(shifted), expected)


def test_one_types_shards_stack_without_changing_a_value():
    parts = [decode("Q4_K", _blocks("Q4_K", seed)) for seed in range(3)]
    stacked = concat_rows(parts)
    expected = np.concatenate([dequantize(_blocks("Q4_K", seed), T.Q4_K) for seed in range(3)])
    assert np.array_equal(_values(stacked), expected)


def test_k_quant_scales_are_kept_as_their_two_float16_factors():
    """Q4_K's group scale d * sc is no float16, its factors are: a weight costs 4.625
    bits (4 + 2 x 16-bit factors per 32 + 2 x 16 per 256) against the file's 4.5."""
    blocks = decode("Q4_K", _blocks("Q4_K"))
    assert blocks.scales.dtype == blocks.mins.dtype == np.float16
    assert blocks.scale_base.shape == (ROWS, COLS // 256)
    product = blocks.scales.astype(np.float32) * np.repeat(blocks.scale_base, 8, axis=1)
    assert not np.array_equal(product.astype(np.float16).astype(np.float32), product)
