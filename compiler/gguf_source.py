"""A GGUF file's tensors as IR weights, read and dequantized one tensor at a time.

The file is memory-mapped (gguf's `GGUFReader`), so a tensor costs memory only while it
is being read: a 7B GGUF compiles in about one layer's float32, as a safetensors directory
does. Each tensor is dequantized by gguf's own `quants.dequantize`, the function
transformers' GGUF loader calls, and laid out as transformers lays it out:

- llama.cpp's converter interleaves the rotary halves of Llama-architecture Q and K rows;
  they are put back (transformers' reverse permute);
- Gemma norms are stored as 1 + w, which is already the IR's form of a Gemma norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmopt.compiler.architectures import GGUF_PERMUTED_QK, GLOBAL_NAMES, ArchFamily
from llmopt.compiler.gguf_blocks import field_string, unpermute_qk_rows
from llmopt.compiler.ir import ArchSpec
from llmopt.compiler.weight_store import TensorSource


@dataclass(frozen=True)
class GGUFTensor:
    """Where one IR weight lies in the GGUF file, and how it becomes the IR's."""

    key: str  # the tensor's GGUF name
    shape: tuple[int, ...]  # the IR's (rows first)
    qk_heads: int = 0  # Q/K rows to un-permute in this many heads (0: none)


class GGUFSource(TensorSource):
    """IR name -> a tensor of one GGUF file, dequantized to float32 on each access."""

    tensors: dict[str, GGUFTensor]

    def __init__(self, path: Path, tensors: dict[str, GGUFTensor]):
        import gguf

        super().__init__(tensors)
        self.path = path
        self._reader = gguf.GGUFReader(str(path))  # memory-mapped: reading costs no copy
        self._by_key = {t.name: t for t in self._reader.tensors}

    def read(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        entry = self.tensors[name]
        stored = self._by_key[entry.key]
        values = dequantize(np.asarray(stored.data), stored.tensor_type)
        # a copy: float tensors come back as read-only views of the mapped file
        tensor = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(entry.shape)
        self.reads += 1
        if entry.qk_heads:
            tensor = tensor[unpermute_qk_rows(entry.shape[0], entry.qk_heads)].contiguous()
        return tensor


def gguf_source(path: Path, family: ArchFamily, arch: ArchSpec) -> GGUFSource | None:
    """The GGUF file's tensors under their IR names, or None where a tensor of the model has
    no counterpart this reader knows (transformers is then left to load the file whole)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    architecture = field_string(reader, "general.architecture")
    model_arch = _model_arch(architecture)
    if model_arch is None:
        return None
    name_map = gguf.get_tensor_name_map(model_arch, arch.num_layers)
    stored = {t.name: t for t in reader.tensors}
    tensors: dict[str, GGUFTensor] = {}
    for hf_name, ir_name in _hf_names(family, arch):
        key = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if key is None or key not in stored:
            continue
        shape = tuple(int(n) for n in reversed(stored[key].shape.tolist()))
        tensors[ir_name] = GGUFTensor(key, shape, _qk_heads(architecture, ir_name, arch))
    if not _complete(tensors, arch):
        return None
    return GGUFSource(path, tensors)


def _model_arch(architecture: str) -> Any:
    """gguf's MODEL_ARCH for a `general.architecture` value (None: gguf knows none)."""
    import gguf

    return next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture), None)


def _hf_names(family: ArchFamily, arch: ArchSpec) -> list[tuple[str, str]]:
    """(HF parameter name, IR name) of every weight the family can have, model order."""
    names = [("model.embed_tokens.weight", GLOBAL_NAMES["model.embed_tokens.weight"])]
    for i in range(arch.num_layers):
        names += [(f"model.layers.{i}.{hf}", f"layers.{i}.{ir}")
                  for hf, ir in family.layer_names.items()]
    names.append(("model.norm.weight", GLOBAL_NAMES["model.norm.weight"]))
    if not arch.tie_word_embeddings:
        names.append(("lm_head.weight", GLOBAL_NAMES["lm_head.weight"]))
    return names


def _qk_heads(architecture: str, ir_name: str, arch: ArchSpec) -> int:
    """Heads whose Q or K rows llama.cpp's converter permuted (0: not permuted)."""
    if architecture not in GGUF_PERMUTED_QK or not ir_name.endswith(("q_proj.weight",
                                                                       "k_proj.weight")):
        return 0
    layer = arch.layers[int(ir_name.split(".")[1])]
    return layer.num_heads if ir_name.endswith("q_proj.weight") else layer.num_kv_heads


def _complete(tensors: dict[str, Any], arch: ArchSpec) -> bool:
    """Every weight a forward needs is there (biases and head norms are optional)."""
    needed = ["embed_tokens", "final_norm"] + ([] if arch.tie_word_embeddings
                                               else ["lm_head.weight"])
    for i in range(arch.num_layers):
        needed += [f"layers.{i}.{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up",
                                                          "down")]
        needed.append(f"layers.{i}.attn_norm")
    return all(name in tensors for name in needed)
