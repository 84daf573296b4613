"""GGUF's quantized blocks split into small integers and the scales that multiply
them, without rounding anything: every kept type reads as w = v * scale (+ min), one
scale (and minimum) per group of inputs, where v is the integer q itself or, for the
types that index a fixed table (IQ4_NL, IQ4_XS, MXFP4), the table's int8 value at
q. A layer holding them computes in float32 exactly the weights
`gguf.quants.dequantize` does (same operands, same operations;
tests/engine/test_gguf_blocks.py checks each type value for value).

The bit layouts are llama.cpp's (ggml-quants.c), read the way gguf.quants reads them.
The K-quants' scales are products of a float16 super-block scale (one per 256
inputs) and a 6- or 8-bit sub-block scale: kept as those two factors, both exact in
float16 (the product is not), and multiplied in float32 as gguf does, so a Q4_K
weight costs 4.6 bits here against 4.5 in the file."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

SUPER_BLOCK = 256  # inputs a K-quant's super-block scale (and minimum) spans


@dataclass
class GroupQuant:
    """A tensor's rows as w = v * scale + min (min absent: 0), v = codebook[q] where
    the type has a codebook, else q. [N, K] integers, [N, K / group] scales and
    minimums (float16 or float32), each times its [N, K / 256] float16 base where
    it has one. `lo`..`hi`: the values the type's q can take, whatever this
    tensor's happen to be."""
    q: np.ndarray  # int16 [N, K]
    scales: np.ndarray
    mins: np.ndarray | None
    lo: int
    hi: int
    scale_base: np.ndarray | None = None
    min_base: np.ndarray | None = None
    codebook: np.ndarray | None = None  # int16 [16]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def fits_int4(self) -> bool:
        """Whether it has a lossless int4 form: 16 codes (of a codebook, or of a grid
        with minimums, or of a symmetric grid that shifts exactly)."""
        if self.codebook is not None:
            return True
        if self.hi - self.lo > 15:
            return False
        return (self.lo == 0) if self.mins is not None else self._shift_mins() is not None

    def _shift_mins(self) -> np.ndarray | None:
        """lo * scale in the scales' own dtype where that is exact, else None."""
        wide = self.scales.astype(np.float32) * self.lo
        mins = wide.astype(self.scales.dtype)
        return mins if np.array_equal(mins.astype(np.float32), wide) else None

    def shifted(self) -> GroupQuant:
        """The int4 form, q in 0..15: a symmetric grid moved up by -lo, with minimum
        lo * scale (times the same base): exact in float32, a small integer times a
        scale of few significant bits."""
        if self.mins is not None or self.codebook is not None:
            return self
        return replace(self, q=self.q - self.lo, mins=self._shift_mins(), lo=0,
                       hi=self.hi - self.lo, min_base=self.scale_base)


def _f16(column: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n, 1] float16."""
    return column.copy().view(np.float16)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """Bytes holding values j (low nibble) and j + span (high) of each run of
    2 * span values -> [n, values] uint8."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, span) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(n, -1)


def _bits(packed: np.ndarray, width: int, shifts: int, span: int) -> np.ndarray:
    """Bytes holding `shifts` fields of `width` bits each (field i of byte j is value
    j + i * span of its run) -> [n, values] uint8."""
    n = packed.shape[0]
    steps = np.arange(0, width * shifts, width, dtype=np.uint8).reshape(1, 1, shifts, 1)
    return ((packed.reshape(n, -1, 1, span) >> steps) & np.uint8((1 << width) - 1)).reshape(n, -1)


def _q4_0(b):
    return dict(q=_nibbles(b[:, 2:], 16).astype(np.int16) - 8, scales=_f16(b[:, :2]),
                mins=None, lo=-8, hi=7)


def _q4_1(b):
    return dict(q=_nibbles(b[:, 4:], 16), scales=_f16(b[:, :2]), mins=_f16(b[:, 2:4]),
                lo=0, hi=15)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: low nibbles from qs, the fifth bit of value i from bit i of qh."""
    high = (qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    return _nibbles(qs, 16) | (high.astype(np.uint8) << np.uint8(4))


def _q5_0(b):
    return dict(q=_five_bits(b[:, 2:6], b[:, 6:]).astype(np.int16) - 16,
                scales=_f16(b[:, :2]), mins=None, lo=-16, hi=15)


def _q5_1(b):
    return dict(q=_five_bits(b[:, 4:8], b[:, 8:]), scales=_f16(b[:, :2]),
                mins=_f16(b[:, 2:4]), lo=0, hi=31)


def _q8_0(b):
    return dict(q=b[:, 2:].copy().view(np.int8), scales=_f16(b[:, :2]), mins=None,
                lo=-128, hi=127)


def _k_scales(b: np.ndarray, scales: np.ndarray) -> dict:
    """Q4_K / Q5_K: eight 6-bit scales and minimums under the float16 d and dmin
    leading the block: scale d * sc, minimum -(dmin * m) (the base -dmin: negating
    is exact)."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(scales)
    return dict(scales=sc.astype(np.float16), scale_base=_f16(b[:, :2]),
                mins=m.astype(np.float16), min_base=-_f16(b[:, 2:4]))


def _q4_k(b):
    return dict(q=_nibbles(b[:, 16:], 32), lo=0, hi=15, **_k_scales(b, b[:, 4:16]))


def _q5_k(b):
    q = _nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 1, 8, 32) << np.uint8(4))
    return dict(q=q, lo=0, hi=31, **_k_scales(b, b[:, 4:16]))


def _q6_k(b):
    low = _nibbles(b[:, :128], 64)
    high = _bits(b[:, 128:192], 2, 4, 32)
    q = (low | (high << np.uint8(4))).astype(np.int16) - 32
    return dict(q=q, scales=b[:, 192:208].view(np.int8).astype(np.float16),
                scale_base=_f16(b[:, 208:210]), mins=None, lo=-32, hi=31)


def _q2_k(b):
    sub = b[:, :16]
    return dict(q=_bits(b[:, 16:80], 2, 4, 32), scales=(sub & 0xF).astype(np.float16),
                scale_base=_f16(b[:, 80:82]), mins=(sub >> 4).astype(np.float16),
                min_base=-_f16(b[:, 82:84]), lo=0, hi=3)


def _q3_k(b):
    low = _bits(b[:, 32:96], 2, 4, 32).astype(np.int16)
    high_clear = _bits(b[:, :32], 1, 8, 32) ^ np.uint8(1)  # a set bit means no -4
    packed = b[:, 96:108]
    nib = _nibbles_in_order(packed[:, :8])
    two = _bits(packed[:, 8:12], 2, 4, 4)
    sub = (nib | (two << np.uint8(4))).astype(np.int16) - 32
    return dict(q=low - 4 * high_clear.astype(np.int16), scales=sub.astype(np.float16),
                scale_base=_f16(b[:, 108:110]), mins=None, lo=-4, hi=3)


def _nibbles_in_order(packed: np.ndarray) -> np.ndarray:
    """Q3_K's sub-block scales: the low nibbles of 8 bytes, then their high ones."""
    return np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=1)


def _iq4_table() -> np.ndarray:
    from gguf.quants import IQ4_NL

    return np.array(IQ4_NL.kvalues, dtype=np.int16)


def _iq4_nl(b):
    return dict(q=_nibbles(b[:, 2:], 16), scales=_f16(b[:, :2]), mins=None,
                codebook=_iq4_table(), lo=0, hi=15)


def _iq4_xs(b):
    high = (b[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    low = _nibbles_in_order(b[:, 4:8])[:, [0, 4, 1, 5, 2, 6, 3, 7]]
    sub = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.int16) - 32
    return dict(q=_nibbles(b[:, 8:], 16), scales=sub.astype(np.float16),
                scale_base=_f16(b[:, :2]), mins=None, codebook=_iq4_table(), lo=0, hi=15)


def _mxfp4(b):
    """gpt-oss's MXFP4: e2m1 values (doubled to integers by gguf's table) times a
    power of two (float16 where it holds it)."""
    from gguf.quants import MXFP4

    scales = MXFP4.e8m0_to_fp32_half(b[:, :1])
    narrow = scales.astype(np.float16)
    if np.array_equal(narrow.astype(np.float32), scales):
        scales = narrow
    return dict(q=_nibbles(b[:, 1:], 16), scales=scales, mins=None,
                codebook=np.array(MXFP4.kvalues, dtype=np.int16), lo=0, hi=15)


# type name -> blocks [n, type size] uint8 -> GroupQuant's fields for those blocks
# (arrays [n, values per block], [n, groups per block], bases [n, 1])
DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
            "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
            "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4}


def decode(kind: str, rows: np.ndarray) -> GroupQuant:
    """[N, bytes per row] uint8 of type `kind` (a DECODERS key) -> its GroupQuant."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n = rows.shape[0]
    fields = DECODERS[kind](np.ascontiguousarray(rows).reshape(-1, size))
    for name in ("q", "scales", "mins", "scale_base", "min_base"):
        if fields.get(name) is not None:
            fields[name] = fields[name].reshape(n, -1)
    fields["q"] = fields["q"].astype(np.int16)
    return GroupQuant(**fields)


def concat_rows(parts: list[GroupQuant]) -> GroupQuant:
    """Shards of one layer (query, key, value) of one type stacked along N."""
    def joined(name: str) -> np.ndarray | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else np.concatenate(values)

    return replace(parts[0], **{name: joined(name) for name in
                                ("q", "scales", "mins", "scale_base", "min_base")})
