"""The GGUF container: metadata key/values and tensor descriptions, parsed straight from the
header, and each tensor's bytes as a read-only memory map.

`gguf.GGUFReader` builds one numpy view per array element, which costs ~5 s for a 49k-token
vocabulary; this parser reads the same header in well under a second, so the front end, the
tokenizer and every DP rank can each open the file without a visible pause. Layout
(little-endian, version 2 and 3): magic, version, tensor count, key/value count, the
key/values, the tensor infos, padding to `general.alignment`, the tensor data.
"""
from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format of one scalar (8 = string, 9 = array are handled apart).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, as torch sees it: GGUF's dims reversed ([out, in] for a linear)
    ggml_type: int          # gguf.GGMLQuantizationType value
    offset: int             # from the start of the file


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}`, e.g. arch_get("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def layer_matrix_types(self) -> frozenset[int]:
        """The GGML types of the decoder layers' matrices (`blk.N.*`, 2-D): what --quantized-activations
        auto decides on (engine/models/int8_linear.py)."""
        return frozenset(info.ggml_type for name, info in self.tensors.items()
                         if name.startswith("blk.") and len(info.shape) == 2)

    def raw_bytes(self, info: TensorInfo, num_bytes: int) -> np.ndarray:
        """The tensor's `num_bytes` bytes, memory-mapped read-only (nothing is copied)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(num_bytes,))


class _Cursor:
    def __init__(self, buffer: mmap.mmap):
        self.buffer, self.pos = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        start, self.pos = self.pos, self.pos + length
        return self.buffer[start:self.pos].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY_DTYPES:  # numbers: one frombuffer, not `count` unpacks
                dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder("<")
                items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
                self.pos += items.nbytes
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])


@functools.lru_cache(maxsize=4)
def _read_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    if size < 24:
        raise ValueError(f"{path} is not a GGUF file (too short)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        if buffer[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                             "a huge number means a big-endian file)")
        try:
            return _parse(path, buffer, tensor_count, kv_count, size)
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: malformed GGUF header ({e})") from None


def _parse(path: Path, buffer: mmap.mmap, tensor_count: int, kv_count: int, size: int) -> GGUFFile:
    cursor = _Cursor(buffer)
    cursor.pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.scalar("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", cursor.buffer, cursor.pos)
        cursor.pos += 8 * n_dims
        ggml_type, offset = cursor.scalar("<I"), cursor.scalar("<Q")
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in infos:
        if name in tensors:
            raise ValueError(f"{path}: tensor {name!r} appears twice")
        if data_start + offset > size:
            raise ValueError(f"{path}: tensor {name!r} starts past the end of the file (truncated?)")
        tensors[name] = TensorInfo(name, shape, ggml_type, data_start + offset)
    return GGUFFile(path, metadata, tensors)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse (once per file version in this process) a GGUF file's header."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _read_cached(path, stat.st_mtime_ns, stat.st_size)


def is_gguf_path(path: str | Path) -> bool:
    """A model or tokenizer path names a GGUF checkpoint when it ends in .gguf."""
    return str(path).lower().endswith(".gguf")
