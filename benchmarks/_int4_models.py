"""Competitor models for bench_int4: the fp32 HF dir, ORT GenAI int4, llama.cpp GGUFs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from _common import REPO_ROOT, save_plain_hf
from bench_foundation import recipe_model

LLAMA_FTYPES = {"smollm2-q4_0.gguf": "LLAMA_FTYPE_MOSTLY_Q4_0",
                "smollm2-q8_0.gguf": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def package_gguf(recipe: Path) -> Path:
    from llmopt.compiler.loader import resolve_checkpoint

    ref = resolve_checkpoint(recipe_model(recipe))
    if not ref.gguf_file:
        sys.exit(f"{recipe}: the recipe's model is not a GGUF file")
    return Path(ref.location) / ref.gguf_file


def ensure_hf_dir(gguf_path: Path, out: Path) -> Path:
    """The GGUF dequantized by transformers to fp32, saved as a Hugging Face directory."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"writing {out} ...", flush=True)
    kwargs = {"gguf_file": gguf_path.name}
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                  **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    tmp = out.with_name(out.name + ".tmp")
    save_plain_hf(loaded, tokenizer, tmp)
    tmp.rename(out)
    return out


def ensure_ort_genai(hf_dir: Path, out: Path) -> Path:
    """onnxruntime-genai's model builder, int4 for the CPU (its defaults: RTN symmetric,
    block 32, every MatMul including the LM head, accuracy level 4)."""
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
           "-o", str(tmp), "-p", "int4", "-e", "cpu", "-c", str(out.parent / "og-cache")]
    run_logged(cmd, out.parent / "ort-genai-build.log")
    tmp.rename(out)
    return out


def ensure_f32_gguf(source: Path, out: Path) -> Path:
    """`source` with every tensor dequantized to F32 (same names, layout and metadata), for
    llama.cpp's quantizer: llama-cpp-python ships no HF -> GGUF converter."""
    if out.is_file():
        return out
    import gguf
    import numpy as np

    print(f"writing {out} ...", flush=True)
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def ensure_llama_quant(f32_gguf: Path, out: Path) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, default params) on the F32 GGUF."""
    if out.is_file():
        return out
    import llama_cpp as lc

    print(f"quantizing {out} ...", flush=True)
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, LLAMA_FTYPES[out.name])
    tmp = out.with_name(out.name + ".tmp")
    if lc.llama_model_quantize(str(f32_gguf).encode(), str(tmp).encode(), params) != 0:
        sys.exit(f"llama_model_quantize failed for {out}")
    tmp.rename(out)
    return out


def run_logged(cmd: list[str], log: Path) -> None:
    print(f"running {' '.join(cmd)} (log: {log}) ...", flush=True)
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{cmd[:4]} failed; see {log}")
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
