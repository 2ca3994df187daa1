"""A minimal ONNX graph builder: named values in, nodes and initializers out."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

MS_DOMAIN = "com.microsoft"
# Initializers at least this large (as `sys.getsizeof` counts their bytes, which is what
# onnx's own converter compares) go to the weights file.
EXTERNAL_THRESHOLD = 1024


class GraphBuilder:
    """Appends nodes with fresh output names; constants and weights become initializers.

    With `data_file`, each large initializer is appended to that file as it is added (the
    layout `onnx.save_model(..., save_as_external_data=True)` would write), so a graph of
    any size never holds its weights in memory.
    """

    def __init__(self, name: str, opset: int, data_file: Path | None = None):
        self.name, self.opset = name, opset
        self.data_file = data_file
        if data_file is not None:
            data_file.write_bytes(b"")
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.domains: set[str] = set()
        self._counter = 0

    def fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}_{self._counter}"

    def op(self, op_type: str, inputs: list[str], *, name: str = "", outputs: int = 1,
           domain: str = "", **attrs: object) -> str | list[str]:
        """Add a node; returns its output name (or names when outputs > 1)."""
        hint = name or op_type.lower()
        out_names = [self.fresh(hint) for _ in range(outputs)]
        self.nodes.append(
            helper.make_node(op_type, inputs, out_names, name=self.fresh(hint + "_node"),
                             domain=domain, **attrs)
        )
        if domain:
            self.domains.add(domain)
        return out_names[0] if outputs == 1 else out_names

    def op_into(self, op_type: str, inputs: list[str], outputs: list[str], *,
                domain: str = "", **attrs: object) -> None:
        """Add a node whose outputs have given names (graph outputs, unused slots '')."""
        self.nodes.append(
            helper.make_node(op_type, inputs, outputs, name=self.fresh(op_type.lower() + "_node"),
                             domain=domain, **attrs)
        )
        if domain:
            self.domains.add(domain)

    def rename(self, value: str, new_name: str) -> str:
        """Give a just-produced, not yet consumed value a new name (e.g. a graph output)."""
        for node in reversed(self.nodes):
            if value in node.output:
                node.output[list(node.output).index(value)] = new_name
                return new_name
        raise KeyError(f"no node produces {value!r}")

    def weight(self, name: str, array: np.ndarray) -> str:
        if name in self.initializers:
            return name
        array = np.ascontiguousarray(array)
        external = self.data_file is not None and (
            array.nbytes + sys.getsizeof(b"") >= EXTERNAL_THRESHOLD)
        if external and array.dtype in NP_TO_ONNX:  # written from the array: no bytes copy
            tensor = onnx.TensorProto(name=name, dims=array.shape,
                                      data_type=NP_TO_ONNX[array.dtype])
            self._append_external(tensor, memoryview(array).cast("B"))
        else:
            tensor = numpy_helper.from_array(array, name)
            if external:
                self._append_external(tensor, tensor.raw_data)
                tensor.ClearField("raw_data")
        self.initializers[name] = tensor
        return name

    def _append_external(self, tensor: onnx.TensorProto, data: bytes | memoryview) -> None:
        with self.data_file.open("ab") as file:
            offset = file.tell()
            file.write(data)
        # The entries onnx's `set_external_data` writes, in its order (it needs raw_data).
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", self.data_file.name), ("offset", offset),
                           ("length", len(data))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)

    def const(self, value: object, dtype: type = np.int64) -> str:
        array = np.asarray(value, dtype=dtype)
        name = f"const_{array.dtype.name}_{'_'.join(map(str, array.ravel().tolist()))}"
        name = name.replace("-", "m").replace(".", "p")[:120]
        return self.weight(name, array)

    def input(self, name: str, elem_type: int, shape: list[object]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list[object]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, self.name, self.inputs, self.outputs, list(self.initializers.values())
        )
        opsets = [helper.make_opsetid("", self.opset)]
        opsets += [helper.make_opsetid(d, 1) for d in sorted(self.domains)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="llmopt")
        model.ir_version = 10
        return model


def save_with_external_data(model: onnx.ModelProto, path: Path) -> str:
    """Write `path` plus one weights file beside it (no 2 GB protobuf limit); a graph built
    with its weights already streamed there is written as it is."""
    data_name = path.name + ".data"
    if any(uses_external_data(t) for t in model.graph.initializer):
        if not (path.parent / data_name).is_file():
            raise FileNotFoundError(f"{path.parent / data_name}: the graph's weights file")
        onnx.save_model(model, str(path))
        return data_name
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
        location=data_name, size_threshold=1024,
    )
    return data_name


NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.uint16): TensorProto.UINT16,
    np.dtype(np.int64): TensorProto.INT64,
}
