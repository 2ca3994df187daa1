"""The runtime's protobuf reader agrees with the `onnx` package on a graph's signature."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmopt.runtime.artifact.onnx_signature import ProtobufError, read_signature


def onnx_signature(model: onnx.ModelProto):
    def io(values):
        out = {}
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else d.dim_param
                     for d in t.shape.dim]
            out[v.name] = (helper.tensor_dtype_to_np_dtype(t.elem_type).name, shape)
        return out

    inits = {i.name: list(i.dims) for i in model.graph.initializer}
    return io(model.graph.input), io(model.graph.output), inits


def test_a_small_graph_reads_as_onnx_reads_it(tmp_path):
    from toy_artifact import build_graph

    model = build_graph()
    onnx.save(model, tmp_path / "toy.onnx")
    signature = read_signature(tmp_path / "toy.onnx")
    assert (signature.inputs, signature.outputs, signature.initializers) == \
        onnx_signature(model)
    assert signature.inputs["past.0.value"] == ("float16", ["nb", "bs", 2])


def test_large_dims_and_external_data(tmp_path):
    """Multi-byte varints, an unnamed dimension, weights kept in an external file."""
    weight = numpy_helper.from_array(np.zeros((300, 70000), np.float16), "big")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.INT8, [None, 131072, "k"])],
        [helper.make_tensor_value_info("y", TensorProto.INT8, [None, 131072, "k"])], [weight])
    model = helper.make_model(graph)
    onnx.save(model, tmp_path / "g.onnx", save_as_external_data=True, location="g.data",
              size_threshold=0)
    signature = read_signature(tmp_path / "g.onnx")
    assert signature.inputs["x"] == ("int8", ["", 131072, "k"])
    assert signature.initializers == {"big": [300, 70000]}


def test_bytes_that_are_not_a_graph_are_refused(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"\x0a\xff\xff\xff")
    with pytest.raises(ProtobufError):
        read_signature(tmp_path / "bad.onnx")
