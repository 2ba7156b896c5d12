"""Element types on the wire and their conversions, in plain numpy (no torch).

Three element types travel: float32, float16 and bfloat16. numpy has no bfloat16, so bfloat16 data is
carried as raw ``uint16`` words and converted to and from float32 here with integer arithmetic:
widening is a 16-bit shift, narrowing rounds to nearest-even and keeps NaN a (quiet) NaN, which is
what torch does. The aggregator accumulates all three in float32.
"""

from __future__ import annotations

import enum

import numpy as np


class DType(enum.IntEnum):
    """Wire code of an element type."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype that holds the raw elements (uint16 for bfloat16)."""
        return _STORAGE[self]

    @property
    def magnitude_mask(self) -> int:
        """Bits of one element that are not the sign bit: an element is zero iff these are all 0."""
        return 0x7FFFFFFF if self is DType.FLOAT32 else 0x7FFF


_STORAGE: dict[DType, np.dtype] = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.BFLOAT16: np.dtype("<u2"),
}

SUPPORTED = "float32, float16 and bfloat16"


def dtype_from_name(name: str) -> DType:
    """Map a dtype name (numpy's or torch's, e.g. ``float32``, ``torch.bfloat16``) to its wire code."""
    key = name.removeprefix("torch.")
    table = {"float32": DType.FLOAT32, "float": DType.FLOAT32, "float16": DType.FLOAT16,
             "half": DType.FLOAT16, "bfloat16": DType.BFLOAT16}
    if key not in table:
        hint = ""
        if key in ("float64", "double"):
            hint = (": convert it first (x.float() for a torch tensor, x.astype(numpy.float32) for a numpy array), "
                    "or reduce float64 through torch.distributed.all_reduce")
        raise TypeError(f"omnireduce reduces {SUPPORTED} tensors; got dtype {name}{hint}")
    return table[key]


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 words (uint16) to float32 exactly."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Narrow float32 to raw bfloat16 words, rounding to nearest-even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return out


def widen(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """Elements of ``dtype`` (in their storage type) as float32, without copying float32."""
    if dtype is DType.BFLOAT16:
        return bf16_to_f32(raw)
    return raw.astype(np.float32, copy=False)


def narrow(values: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 values converted to the storage type of ``dtype`` (rounding once)."""
    if dtype is DType.BFLOAT16:
        return f32_to_bf16(values)
    return values.astype(dtype.storage, copy=False)
