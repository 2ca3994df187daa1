"""A toy artifact whose ONNX graph follows the paged-KV contract with standard ops.

Layer 0 has two pool tensors: "key" (float32 [1], the token id) and "value" (float16 [2],
token id and position). The next token after tokens t_0..t_k is
sum_p (t_p + 1) * (p + 1) mod VOCAB, with the earlier tokens read back from the key pool
through the block table, masked by context_lens; logits are -(v - next)^2.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import tokenizers
from onnx import TensorProto, helper, numpy_helper
from tokenizers import models, pre_tokenizers

from llmopt.runtime.contract import FORMAT_VERSION

VOCAB = 64
EOS = 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def next_token(tokens: Sequence[int]) -> int:
    return sum((t + 1) * (p + 1) for p, t in enumerate(tokens)) % VOCAB


def toy_logits(tokens: Sequence[int]) -> np.ndarray:
    return -((np.arange(VOCAB) - next_token(tokens)) ** 2).astype(np.float32)


def reference_greedy(prompt: Sequence[int], max_tokens: int, eos: int | None = EOS) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
        if tokens[-1] == eos:
            break
    return tokens[len(prompt) :]


def build_graph() -> onnx.ModelProto:
    nodes = []

    def op(op_type: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op_type, inputs, [output], **attrs))
        return output

    inits = [
        numpy_helper.from_array(np.array(v, dtype=np.int64), name)
        for name, v in {
            "one": 1,
            "zero": 0,
            "vocab": VOCAB,
            "axis1": [1],
            "axis2": [2],
            "flat2": [0, -1],
            "flat1": [-1],
            "arange_vocab": np.arange(VOCAB),
        }.items()
    ]
    x = "input_ids"
    pos = "position_ids"
    op("Cast", [op("Unsqueeze", [x, "axis2"], "x3")], "new.0.key", to=TensorProto.FLOAT)
    op("Unsqueeze", [pos, "axis2"], "pos3")
    op("Concat", ["x3", "pos3"], "xv", axis=2)
    op("Cast", ["xv"], "new.0.value", to=TensorProto.FLOAT16)

    # Context: gather the key pool through the block tables, mask by context_lens.
    op("Gather", ["past.0.key", "block_tables"], "gathered", axis=0)  # [B, M, bs, 1]
    op("Cast", [op("Reshape", ["gathered", "flat2"], "gflat")], "gtok", to=TensorProto.INT64)
    op("Shape", ["gtok"], "glen", start=1, end=2)
    op("Range", ["zero", op("Squeeze", ["glen"], "glen0"), "one"], "kpos")  # [L]
    op("Less", ["kpos", op("Unsqueeze", ["context_lens", "axis1"], "ctx2")], "mask")
    op("Mul", [op("Add", ["gtok", "one"], "gtok1"), op("Add", ["kpos", "one"], "kpos1")], "terms")
    op("Where", ["mask", "terms", "zero"], "masked")
    op("ReduceSum", ["masked", "axis1"], "ctx_sum", keepdims=1)  # [B, 1]

    # The step's own tokens, causally: a cumulative sum over the query axis.
    op("Mul", [op("Add", [x, "one"], "x1"), op("Add", [pos, "one"], "pos1")], "step_terms")
    op("CumSum", ["step_terms", op("Squeeze", ["axis1"], "axis1s")], "cum")
    op("Add", ["ctx_sum", "cum"], "total")
    op("Gather", [op("Reshape", ["total", "flat1"], "tflat"), "logits_indices"], "sel", axis=0)
    op("Mod", ["sel", "vocab"], "target")
    op("Sub", ["arange_vocab", op("Unsqueeze", ["target", "axis1"], "target2")], "diff")
    op(
        "Cast",
        [op("Neg", [op("Mul", ["diff", "diff"], "sq")], "nsq")],
        "logits",
        to=TensorProto.FLOAT,
    )

    i64 = TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["B", "S"]),
        helper.make_tensor_value_info("position_ids", i64, ["B", "S"]),
        helper.make_tensor_value_info("block_tables", i64, ["B", "M"]),
        helper.make_tensor_value_info("context_lens", i64, ["B"]),
        helper.make_tensor_value_info("logits_indices", i64, ["N"]),
        helper.make_tensor_value_info("past.0.key", TensorProto.FLOAT, ["nb", "bs", 1]),
        helper.make_tensor_value_info("past.0.value", TensorProto.FLOAT16, ["nb", "bs", 2]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", VOCAB]),
        helper.make_tensor_value_info("new.0.key", TensorProto.FLOAT, ["B", "S", 1]),
        helper.make_tensor_value_info("new.0.value", TensorProto.FLOAT16, ["B", "S", 2]),
    ]
    graph = helper.make_graph(nodes, "toy_paged", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build_tokenizer() -> tokenizers.Tokenizer:
    """Word level: "<s>"=0, "</s>"=1, "[UNK]"=2, then "w3".."w63"."""
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def manifest_dict(runtime: dict | None = None) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "model": {
            "vocab_size": VOCAB,
            "num_layers": 1,
            "hidden_size": 1,
            "max_position": 256,
            "bos_token_id": 0,
            "eos_token_ids": [EOS],
        },
        "graphs": {"target": {"file": "model.onnx", "opset": 17, "operator_set": "standard"}},
        "kv_cache": {
            "layers": [
                {
                    "tensors": [
                        {"name": "key", "dtype": "float32", "slot_shape": [1]},
                        {"name": "value", "dtype": "float16", "slot_shape": [2]},
                    ]
                }
            ]
        },
        "runtime": runtime
        or {"block_size": 4, "max_context": 64, "max_num_seqs": 8, "max_num_batched_tokens": 16},
        "tokenizer": {
            "file": "tokenizer.json",
            "chat_template": CHAT_TEMPLATE,
            "add_bos_token": True,
            "bos_token": "<s>",
            "eos_token": "</s>",
        },
        "generation": {"do_sample": False, "max_new_tokens": 8},
    }


def build_artifact(directory: Path, runtime: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(build_graph(), directory / "model.onnx")
    build_tokenizer().save(str(directory / "tokenizer.json"))
    manifest = manifest_dict(runtime)
    manifest["files"] = {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in ("model.onnx", "tokenizer.json")
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return directory


def add_draft(directory: Path, gamma: int, *, model: bool = True, ngram: bool = False,
              max_batch_size: int = 16) -> Path:
    """Give the toy artifact a speculative section: its own graph again as a (perfect)
    draft model with its own KV pool, and/or n-gram lookup."""
    manifest = json.loads((directory / "manifest.json").read_text())
    speculative: dict = {"gamma": gamma, "max_batch_size": max_batch_size}
    if model:
        (directory / "draft.onnx").write_bytes((directory / "model.onnx").read_bytes())
        manifest["graphs"]["draft"] = {**manifest["graphs"]["target"], "file": "draft.onnx"}
        manifest["files"]["draft.onnx"] = manifest["files"]["model.onnx"]
        speculative["model"] = {"kind": "model", "kv_cache": manifest["kv_cache"],
                                "vocab_size": VOCAB,
                                "max_position": manifest["model"]["max_position"]}
    if ngram:
        speculative["ngram"] = {"min_n": 1, "max_n": 3}
    manifest["speculative"] = speculative
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return directory
