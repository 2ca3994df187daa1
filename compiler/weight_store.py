"""The IR's weights, read when asked: a read-only source below a writable overlay.

`WeightStore` is a `MutableMapping[str, torch.Tensor]` giving float32 tensors by IR name,
so passes index it as they would a dict. What it saves is memory:

- a source tensor (a safetensors checkpoint) is read from disk and converted to float32
  on each access and never cached, so a pass that walks the model one layer at a time
  holds one layer;
- a pass's result is stored in the overlay, either as a tensor or as a thunk that
  computes it on access (a quantized linear's dequantized weight), so fake-quantized
  float copies of a whole model never exist at once;
- `copy()` shares the source and copies the overlay's references: cheap, and the copy's
  writes never reach the original.

`QuantizedStore` holds the passes' integer weights, optionally spilled to files in a
directory (the compile's scratch space), and a pre-quantized checkpoint's, left in its
files until read, so their codes need not fit in memory either.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmopt.compiler.quant_format import QuantizedLinear


@dataclass(frozen=True)
class SourceTensor:
    """Where one IR weight lies in a safetensors file, and how it becomes the IR's."""

    file: Path
    key: str  # the tensor's name in the file
    shape: tuple[int, ...]
    offset: float = 0.0  # added after conversion (Gemma's `1 + w` norm weights)
    dtype: str = "F32"  # as safetensors names it: "BF16", "F16", "F32"


def index_safetensors(files: list[Path]) -> dict[str, SourceTensor]:
    """Every tensor of safetensors files by its name in them, headers read, no data."""
    from safetensors import safe_open

    tensors: dict[str, SourceTensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = f.keys()  # a safe_open handle is not iterable
            for key in keys:
                stored = f.get_slice(key)
                tensors[key] = SourceTensor(file, key, tuple(stored.get_shape()),
                                            dtype=stored.get_dtype())
    return tensors


RowBlock = tuple[int, torch.Tensor]  # (first row, float32 rows): `row_blocks` yields them
# Rows per block in a streamed read: a block of float32 rows this size stays in cache while a
# matmul reads it, so the weight is read from memory once in its stored form.
ROW_BLOCK_BYTES = 2 << 20


def rows_per_block(columns: int) -> int:
    return max(1, ROW_BLOCK_BYTES // (4 * columns))


def slice_rows(tensor: torch.Tensor, rows: int) -> Iterator[RowBlock]:
    for start in range(0, tensor.shape[0], rows):
        yield start, tensor[start:start + rows]


class TensorSource(ABC):
    """A checkpoint's tensors by IR name, read (in float32) on each access: `tensors` maps
    each name to an entry with its `shape`; a subclass reads one."""

    def __init__(self, tensors: dict[str, Any]):
        self.tensors = tensors
        self.reads = 0  # how many tensors were read: what tests count

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def stored_dtype(self, name: str) -> str:
        """The tensor's dtype in the checkpoint, as safetensors names it ("F32" where the
        source converts to float32 from another encoding)."""
        return getattr(self.tensors[name], "dtype", "F32")

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`, in float32 (counted in `reads`)."""

    def row_blocks(self, name: str, rows: int) -> Iterator[RowBlock]:
        """The tensor `name` in float32 blocks of `rows` rows; this default reads it whole."""
        yield from slice_rows(self.read(name), rows)


class SafetensorsSource(TensorSource):
    """IR name -> a tensor of safetensors files, read in float32 on each access."""

    tensors: dict[str, SourceTensor]

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        entry = self.tensors[name]
        with safe_open(str(entry.file), framework="pt") as f:
            tensor = f.get_tensor(entry.key)
        self.reads += 1
        tensor = tensor.to(torch.float32).contiguous()
        return tensor + entry.offset if entry.offset else tensor

    def row_blocks(self, name: str, rows: int) -> Iterator[RowBlock]:
        """Blocks read from the file one at a time: never the whole tensor in float32."""
        from safetensors import safe_open

        entry = self.tensors[name]
        with safe_open(str(entry.file), framework="pt") as f:
            stored = f.get_slice(entry.key)
            for start in range(0, entry.shape[0], rows):
                block = stored[start:start + rows].to(torch.float32)
                yield start, block + entry.offset if entry.offset else block
        self.reads += 1


@dataclass
class _Thunk:
    """A weight computed on access (never cached), with its shape known up front, and
    optionally a block of rows at a time."""

    compute: Callable[[], torch.Tensor]
    shape: tuple[int, ...]
    blocks: Callable[[int], Iterator[RowBlock]] | None = None


class WeightStore(MutableMapping[str, torch.Tensor]):
    """IR weights: overlay (tensors or thunks) over an optional lazily read source."""

    def __init__(self, source: TensorSource | None = None,
                 overlay: Mapping[str, torch.Tensor | _Thunk] | None = None,
                 deleted: set[str] | None = None):
        self.source = source
        self.overlay: dict[str, torch.Tensor | _Thunk] = dict(overlay or {})
        self.deleted: set[str] = set(deleted or ())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.overlay:
            value = self.overlay[name]
            return value.compute() if isinstance(value, _Thunk) else value
        if self.source is not None and name in self.source and name not in self.deleted:
            return self.source.read(name)
        raise KeyError(name)

    def row_blocks(self, name: str, rows: int) -> Iterator[RowBlock]:
        """The weight `name` (2-D) in float32 blocks of `rows` rows, in order: a reader that
        streams them holds one block where `self[name]` would hold the whole float tensor."""
        value = self.overlay.get(name)
        if isinstance(value, _Thunk) and value.blocks is not None:
            yield from value.blocks(rows)
        elif value is not None:
            yield from slice_rows(value.compute() if isinstance(value, _Thunk) else value, rows)
        elif self.source is not None and name in self.source and name not in self.deleted:
            yield from self.source.row_blocks(name, rows)
        else:
            raise KeyError(name)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self.overlay[name] = tensor
        self.deleted.discard(name)

    def set_lazy(self, name: str, compute: Callable[[], torch.Tensor], shape: tuple[int, ...],
                 blocks: Callable[[int], Iterator[RowBlock]] | None = None) -> None:
        """`name` is computed by `compute()` on each access (`blocks(rows)`: the same, a
        block of rows at a time)."""
        self.overlay[name] = _Thunk(compute, tuple(shape), blocks)
        self.deleted.discard(name)

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.overlay.pop(name, None)
        if self.source is not None and name in self.source:
            self.deleted.add(name)

    def __contains__(self, name: object) -> bool:
        if name in self.overlay:
            return True
        return self.source is not None and name in self.source and name not in self.deleted

    def __iter__(self) -> Iterator[str]:
        seen = set()
        if self.source is not None:
            for name in self.source.names():
                if name not in self.deleted:
                    seen.add(name)
                    yield name
        for name in list(self.overlay):
            if name not in seen:
                yield name

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def shape(self, name: str) -> tuple[int, ...]:
        """A weight's shape without reading it."""
        if name in self.overlay:
            value = self.overlay[name]
            return value.shape if isinstance(value, _Thunk) else tuple(value.shape)
        if name in self:
            return self.source.shape(name)
        raise KeyError(name)

    def source_dtype(self, name: str) -> str | None:
        """The checkpoint's dtype of `name` as safetensors names it, or None where the weight
        is not the checkpoint's (a pass rewrote it, or it never came from one)."""
        if name in self.overlay or self.source is None or name not in self:
            return None
        return self.source.stored_dtype(name)

    def numel(self) -> int:
        """Parameters over every weight, from shapes alone."""
        return sum(int(np.prod(self.shape(name))) for name in self)

    def copy(self) -> WeightStore:
        return WeightStore(self.source, self.overlay, self.deleted)


@dataclass
class _Spilled:
    """A quantized linear written to a scratch file: its header stays in memory."""

    path: Path
    bits: int
    group_size: int
    symmetric: bool
    shape: tuple[int, int]


@dataclass
class _Deferred:
    """A quantized linear read from its source checkpoint on each access: its header stays
    in memory."""

    read: Callable[[], QuantizedLinear]
    bits: int
    group_size: int
    symmetric: bool
    shape: tuple[int, int]


@dataclass
class QuantizedStore(MutableMapping[str, QuantizedLinear]):
    """Linear name -> its integer weights; spilled to `spill_dir` when one is set."""

    entries: dict[str, QuantizedLinear | _Spilled | _Deferred] = field(default_factory=dict)
    spill_dir: Path | None = None

    def __getitem__(self, name: str) -> QuantizedLinear:
        value = self.entries[name]
        if isinstance(value, _Spilled):
            return _read_spilled(value)
        return value.read() if isinstance(value, _Deferred) else value

    def __setitem__(self, name: str, q: QuantizedLinear) -> None:
        self.entries[name] = _spill(q, self.spill_dir) if self.spill_dir is not None else q

    def defer(self, name: str, read: Callable[[], QuantizedLinear]) -> None:
        """`name` is `read()` on each access (a checkpoint's module, left in its files);
        read once now for its header, which also raises any refusal before work starts."""
        q = read()
        self.entries[name] = _Deferred(read, q.bits, q.group_size, q.symmetric, q.shape)

    def __delitem__(self, name: str) -> None:
        del self.entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.entries))

    def __len__(self) -> int:
        return len(self.entries)

    def shape(self, name: str) -> tuple[int, int]:
        return self.entries[name].shape

    def layout(self, name: str) -> tuple[int, int, tuple[int, int]]:
        """(bits, group_size, shape) of a linear, without reading its codes."""
        entry = self.entries[name]
        return entry.bits, entry.group_size, tuple(entry.shape)

    def scheme(self, name: str) -> tuple[int, int, bool]:
        """(bits, group_size, symmetric) of a linear, without reading its codes."""
        entry = self.entries[name]
        return entry.bits, entry.group_size, entry.symmetric

    def copy(self) -> QuantizedStore:
        return QuantizedStore(dict(self.entries), self.spill_dir)


def _spill(q: QuantizedLinear, directory: Path) -> _Spilled:
    """Write q's arrays to a new file in `directory` (files are never rewritten: copies of
    the store may still point at older ones)."""
    handle, name = tempfile.mkstemp(prefix="quantized-", suffix=".npz", dir=directory)
    os.close(handle)
    path = Path(name)
    arrays = {"codes": q.codes.numpy(), "scales": q.scales.numpy(), "zeros": q.zeros.numpy()}
    if q.codebook is not None:
        arrays["codebook"] = q.codebook.numpy()
    np.savez(path, **arrays)
    return _Spilled(path, q.bits, q.group_size, q.symmetric, tuple(q.codes.shape))


def _read_spilled(entry: _Spilled) -> QuantizedLinear:
    with np.load(entry.path) as arrays:
        codebook = torch.from_numpy(arrays["codebook"]) if "codebook" in arrays else None
        return QuantizedLinear(entry.bits, entry.group_size, torch.from_numpy(arrays["codes"]),
                               torch.from_numpy(arrays["scales"]),
                               torch.from_numpy(arrays["zeros"]), entry.symmetric, codebook)
