"""A graph's signature read straight from its ONNX protobuf: I/O dtypes and shapes, and
initializer shapes, without the `onnx` package (the runtime does not import it) and
without reading weights (large fields are skipped by length).

Only the fields needed are decoded (onnx.proto3): ModelProto.graph = 7; GraphProto
initializer = 5, input = 11, output = 12; ValueInfoProto name = 1, type = 2;
TypeProto tensor_type = 1; TypeProto.Tensor elem_type = 1, shape = 2;
TensorShapeProto dim = 1; Dimension dim_value = 1, dim_param = 2;
TensorProto dims = 1, data_type = 2, name = 8.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# TensorProto.DataType -> numpy dtype name (the manifest's spelling).
_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32",
           7: "int64", 9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64"}

Shape = list[int | str]  # fixed dimensions as ints, symbolic ones by name ("" if unnamed)


@dataclass(frozen=True)
class GraphSignature:
    inputs: dict[str, tuple[str, Shape]]  # name -> (dtype name, shape)
    outputs: dict[str, tuple[str, Shape]]
    initializers: dict[str, list[int]]  # name -> dims


class ProtobufError(ValueError):
    """The bytes are not the protobuf message they were read as."""


def read_signature(file: Path) -> GraphSignature:
    """The signature of the ONNX graph in `file` (external weights are never opened)."""
    data = memoryview(file.read_bytes())
    graph = next((value for field, value in _fields(data) if field == 7), None)
    if graph is None:
        raise ProtobufError("no graph")
    inputs, outputs, initializers = {}, {}, {}
    for field, value in _fields(graph):
        if field == 11:
            name, io = _value_info(value)
            inputs[name] = io
        elif field == 12:
            name, io = _value_info(value)
            outputs[name] = io
        elif field == 5:
            name, dims = _tensor_dims(value)
            initializers[name] = dims
    return GraphSignature(inputs, outputs, initializers)


def _value_info(data: memoryview) -> tuple[str, tuple[str, Shape]]:
    name, dtype, shape = "", "undefined", []
    for field, value in _fields(data):
        if field == 1:
            name = bytes(value).decode()
        elif field == 2:
            tensor = next((v for f, v in _fields(value) if f == 1), None)
            if tensor is not None:
                dtype, shape = _tensor_type(tensor)
    return name, (dtype, shape)


def _tensor_type(data: memoryview) -> tuple[str, Shape]:
    dtype, shape = "undefined", []
    for field, value in _fields(data):
        if field == 1:
            dtype = _DTYPES.get(value, f"onnx type {value}")
        elif field == 2:
            shape = [_dimension(dim) for f, dim in _fields(value) if f == 1]
    return dtype, shape


def _dimension(data: memoryview) -> int | str:
    for field, value in _fields(data):
        if field == 1:
            return value
        if field == 2:
            return bytes(value).decode()
    return ""


def _tensor_dims(data: memoryview) -> tuple[str, list[int]]:
    name, dims = "", []
    for field, value in _fields(data):
        if field == 1:  # repeated int64: packed (bytes) or one varint per field
            dims += list(_varints(value)) if isinstance(value, memoryview) else [value]
        elif field == 8:
            name = bytes(value).decode()
    return name, dims


def _fields(data: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of a message: varints as ints, length-delimited as views."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield field, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > end:
                raise ProtobufError("a field runs past the end of its message")
            yield field, data[pos:pos + length]
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ProtobufError(f"unknown wire type {wire}")


def _varints(data: memoryview) -> Iterator[int]:
    pos = 0
    while pos < len(data):
        value, pos = _varint(data, pos)
        yield value


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
