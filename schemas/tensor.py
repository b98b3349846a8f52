"""Compact tensors on the wire: ``{dtype, shape, data}`` with little-endian raw bytes.

Embeddings travel as float16 by default (half the bytes of float32, cosine to the float32
vector above 0.9999 for unit vectors of a few hundred dimensions).
"""

from __future__ import annotations

from typing import Any

import numpy as np

WIRE_DTYPES = {"float32": "<f4", "float16": "<f2", "int8": "i1", "int64": "<i8", "int32": "<i4"}
MAX_ELEMENTS = 1 << 22


def to_wire(array: np.ndarray, dtype: str = "float16") -> dict[str, Any]:
    """Encode an array as a wire tensor map, converting to ``dtype``."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"unsupported wire dtype {dtype!r}")
    arr = np.ascontiguousarray(np.asarray(array), dtype=WIRE_DTYPES[dtype])
    return {"dtype": dtype, "shape": list(arr.shape), "data": arr.tobytes()}


def from_wire(m: dict[str, Any]) -> np.ndarray:
    """Decode a wire tensor map; raises ``ValueError`` when it is malformed."""
    try:
        dtype, shape, data = m["dtype"], [int(d) for d in m["shape"]], m["data"]
    except (KeyError, TypeError, ValueError):
        raise ValueError("tensor map needs dtype, shape and data") from None
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"unsupported wire dtype {dtype!r}")
    count = int(np.prod(shape)) if shape else 1
    if count > MAX_ELEMENTS or any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {shape} is out of bounds")
    arr = np.frombuffer(data, dtype=WIRE_DTYPES[dtype])
    if arr.size != count:
        raise ValueError(f"tensor data has {arr.size} elements, shape {shape} needs {count}")
    return arr.reshape(shape)
