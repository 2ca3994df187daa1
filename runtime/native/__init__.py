"""The native decoder step: one C call per engine step for the lanes graphs it knows.

ONNX Runtime runs a step as ~300 nodes (SmolLM2), each dispatched on its own and with
MatMulNBits reading ~67 % of the memory bandwidth at batch 1. `kernels.c` (ours, built
by `pip install`) runs the same computation in one call over the step's packed tokens:
int4/int8 block-quantized projections on int8 activations with AVX-512 VNNI (and, for 16
activation rows or more, AMX int8 tiles where the CPU has them: bit for bit the same result,
`LLMOPT_NATIVE_AMX=0` turns them off), rotary,
keys and values written into the sequence's lane (float32, or the `kv_cache` pass's int8/int4
codes with static per-channel scales), attention over the lane, RMS norms.
It reads the artifact's weights where the compiler wrote them (the graph's weights file,
memory-mapped; `compiler/native_plan.py` records where each one is) and the same KV lanes
as `LaneExecutor`, so everything above the executor (block tables, prefix caching,
preemption) is the engine's as before.

`kernels` in `EngineOptions` (CLI `--kernels`): `auto`, the default, takes it where it runs
and ONNX Runtime elsewhere; `native` insists; `onnxruntime` never uses it. ONNX Runtime
stays the reference path: every graph runs there, and the native step is checked against
it in the tests.
"""

from __future__ import annotations

from llmopt.runtime.native.library import require_native, unavailable_reason

KERNELS = ("onnxruntime", "native", "auto")

__all__ = ["KERNELS", "require_native", "unavailable_reason"]
