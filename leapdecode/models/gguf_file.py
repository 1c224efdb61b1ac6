"""A GGUF file opened for loading: its metadata and tensor table read straight from the header, its tensor data
memory-mapped (nothing is read until a tensor is used).

gguf-py's own reader builds a numpy view per metadata element, which takes seconds on a 49k-token vocabulary
(and keeps fragments of that work in the process's heap); this reader parses the header with ``struct`` and
``numpy.frombuffer`` in tens of milliseconds. The tensor data is one ``mmap`` of the file; a tensor's blocks are
a zero-copy numpy view of it, and :meth:`GGUFFile.release` drops a tensor's pages from this process once they
have been repacked (they stay in the page cache for the next load).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    type_name: str  # ggml type name: "Q4_K", "F32", ... (or "type-N" for an id this gguf version does not know)
    shape: tuple[int, ...]  # row-major (outermost first), as numpy and torch see it
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata (``fields``), tensors (``tensors``, in file order) and zero-copy data views of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._read_header()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            raise ValueError(f"{self.path.name} is not a readable GGUF file: {e}") from None

    # ------------------------------------------------------------------------------------------- header parsing
    def _take(self, fmt: str):
        v = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return v[0]

    def _string(self) -> str:
        n = self._take("<Q")
        s = self._mm[self._pos: self._pos + n].decode("utf-8", errors="replace")
        if len(s.encode("utf-8", errors="replace")) < n and self._pos + n > len(self._mm):
            raise ValueError("a string runs past the end of the file")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._take(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = self._take("<I"), self._take("<Q")
        if etype in _SCALARS:  # numeric arrays in one read
            dt = np.dtype(_SCALARS[etype])
            arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=self._pos)
            self._pos += dt.itemsize * count
            return arr.copy()
        return [self._value(etype) for _ in range(count)]

    def _read_header(self) -> None:
        if self._mm[:4] != b"GGUF":
            raise ValueError("missing the GGUF magic bytes")
        self._pos = 4
        self.version = self._take("<I")
        if self.version < 2:
            raise ValueError(f"GGUF version {self.version} is too old (2 or newer)")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._take("<Q") for _ in range(self._take("<I"))]
            infos.append((name, dims, self._take("<I"), self._take("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, type_id, off in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
                block, size = GGML_QUANT_SIZES[qtype]
                type_name = qtype.name
            except (ValueError, KeyError):
                type_name, block, size = f"type-{type_id}", 1, 0
            n = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % block:
                raise ValueError(f"tensor {name} ({type_name}) has rows of {dims[0]} values, not whole blocks of "
                                 f"{block}")
            self.tensors.append(GGUFTensor(name, type_name, tuple(int(d) for d in reversed(dims)), start + off,
                                           n // block * size))

    # --------------------------------------------------------------------------------------------------- data
    def data(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only view: quantized types as uint8 [rows, row bytes], float types in
        their dtype and shape."""
        if t.type_name in ("F32", "F16", "BF16"):
            dt = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[t.type_name]
            return np.frombuffer(self._mm, dtype=dt, count=t.nbytes // np.dtype(dt).itemsize,
                                 offset=t.offset).reshape(t.shape)
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(rows, -1)

    def release(self, t: GGUFTensor) -> None:
        """Drop this tensor's mapped pages from the process (a later read maps them again from the page cache)."""
        if hasattr(self._mm, "madvise"):
            start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
            self._mm.madvise(mmap.MADV_DONTNEED, start, min(len(self._mm), t.offset + t.nbytes) - start)

    @property
    def size(self) -> int:
        return len(self._mm)
