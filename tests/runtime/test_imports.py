import subprocess
import sys

CHECK = """
import sys
import llmopt.runtime
from llmopt.runtime import LLM, SamplingParams
import llmopt.runtime.engine, llmopt.runtime.executors.gathered
import llmopt.runtime.llm, llmopt.runtime.tokenizer
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "onnx"))
print(heavy)
"""


def test_runtime_imports_neither_torch_nor_transformers():
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_contract_and_manifest_load_without_onnxruntime():
    code = (
        "import sys, llmopt.runtime.contract, llmopt.runtime.manifest\n"
        "print('onnxruntime' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
