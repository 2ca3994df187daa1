/* llmopt's native decoder step for lanes artifacts (see runtime/native/__init__.py).

One call runs a whole step over the packed query tokens of every sequence: embedding,
each layer (RMS norm, int4/int8 block-quantized projections on int8 activations, rotary,
keys and values written into the sequence's lane where they lie, attention over the
lane), the final norm and the LM head rows asked for. A lane holds float32 keys and values,
or int8/int4 codes with static per-channel scales (the KV-cache pass's layouts that
GroupQueryAttention reads in place), optionally of keys rotated per head. It computes what
the artifact's ONNX graph computes with ONNX Runtime's MatMulNBits at accuracy level 4
(activations quantized to int8 per block of the weights' with scale absmax / 127, rounded
half to even).

Weights: a projection w [N, K] is int codes in quantization blocks of 32, 64 or 128
along K (the last one may be shorter, a multiple of 32) with a float scale per block and an
optional integer zero point (else 2^(bits-1)): w = (code - zero) * scale. Activations are
quantized in the same blocks. The codes are repacked at load (runtime/native/weights.py),
32 columns (a slice) at a time, for one 512-bit VNNI dot per four columns of sixteen rows:
int32 lane i of a dot holds row i's four products with four activation bytes broadcast to
every lane. A slice of sixteen rows is 8 such vectors (8-bit codes), or 4 whose low and
high nibbles are those 8 (4-bit codes). A block's integer dot is the exact sum of its
slices' dots; its float scales apply once per block. Activation rows are quantized into
tiles of eight (QActivations); a full tile times symmetric 4-bit weights runs as one loop
of inline assembly (tile8_q4), every other shape through the same operations written with
intrinsics (gemm_tile).

A sequence's consecutive tokens in one step (a prefill chunk, a token and its drafts)
attend together, up to RUN_TOKENS at a time, reading each lane row once for all of them
(attend_run). A draft tree's tokens take consecutive rows but their depth's position, and
each sees only its ancestors among the step's rows (softmax_shown). On int8 lanes attention
runs in integers: int16 codes of the queries and of the attention weights against the
lanes' codes, exact int32 sums (query_codes, weight_codes).

Every token's result is computed by the same operations in the same order whatever else
the step holds (a block's integer dot is exact; the float sum runs over blocks in order;
a run's token adds exact zeros for the rows past its own), so batching, chunked prefill
and speculation change no output.

The step is one translation unit: this file includes each topic's file below, so that the
compiler sees every function at once and inlines across topics as it would in one file.
*/
#define _GNU_SOURCE 1  /* syscall(), for the AMX tile permission */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "native.h"    /* the structs ctypes mirrors (library.py), the step's tile sizes */
#include "cpu.c"       /* AVX-512 VNNI support, the AMX tile permission */
#include "profile.c"   /* the phase profile */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
#include <immintrin.h>

#include "quantize.c"         /* int8 activations in the weights' blocks */
#include "nf4.c"              /* code-book 4-bit weights (NF4, FP4): a 16-byte lookup */
#include "gemm_vnni.c"        /* projections with VNNI dots (and the assembly tile) */
#include "amx.c"              /* projections on AMX int8 tiles */
#include "gemm.c"             /* a projection split between threads, either path */
#include "pointwise.c"        /* exp, RMS norm, SiLU */
#include "rotary.c"           /* rotary, the KV rotation and its fast Hadamard form */
#include "kv_codes.c"         /* lane rows: float32, float16, int8/int4 codes */
#include "attention_float.c"  /* scores and weighted sums over float-decoded rows */
#include "attention_int8.c"   /* the same in integers on int8 lanes */
#include "attention.c"        /* softmax, a run of query tokens against its lane */
#include "scratch.c"          /* a step's working memory */
#include "layer.c"            /* a layer over a chunk of rows, split between threads */
#include "step.c"             /* a whole step: embedding, layers, the LM head */
#pragma GCC pop_options

#include "layout.c"  /* the structs' layouts, for the ctypes check */

/* A CPython module with no functions: it exists so that the import system finds this
   shared library wherever the package is installed; ctypes calls the functions above. */
static struct PyModuleDef kernels_module = {
    PyModuleDef_HEAD_INIT, "_kernels", "llmopt's native decoder step (called through ctypes)",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
