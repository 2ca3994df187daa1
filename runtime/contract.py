"""The paged-KV I/O contract: the seam between the compiler's graphs and the runtime.

One forward step of a graph takes a right-padded batch of query tokens and returns
logits for the requested rows plus the step's new cache entries. The graph never
sees the whole pool as something to copy: it gathers the blocks named in
`block_tables` and attends over them plus the step's own keys/values.

Inputs (batch B, query length S, M blocks per table, N logit rows):
  input_ids       int64 [B, S]   right-padded query tokens
  position_ids    int64 [B, S]   absolute position of each query token
  block_tables    int64 [B, M]   physical block ids; padding entries point at block 0
  context_lens    int64 [B]      tokens already in the cache before this step
  logits_indices  int64 [N]      rows of the flattened [B*S] hidden states to project
  past.{i}.{t}    [num_blocks, block_size, *slot_shape]   pool tensor t of layer i

Outputs:
  logits          float32 [N, vocab]
  new.{i}.{t}     [B, S, *slot_shape]   what this step writes into pool tensor t

Cache tensors `t` are listed per layer in the manifest (`kv_cache.layers[i].tensors`):
"key" and "value" (slot shape [kv_heads * head_dim], all heads of a token side by side),
plus e.g. "key_scale"/"value_scale" for a quantized KV dtype. Each is indexed by slot
(block * block_size + offset) on its two leading axes, so the runtime writes every
tensor the same way:
`pool.reshape(-1, *slot_shape)[slot_mapping] = new.reshape(-1, *slot_shape)`.

Attention sinks (manifest `kv_cache.sink_tokens` N > 0, blocks layout): a layer with
`sink` tensors keeps the first N positions of each sequence in float32 beside its pool,
in a sink store the runtime keys by the sequence's first block (so a prefix-cache hit
shares them). Extra inputs and outputs:
  sink_rows         int64 [B]            each sequence's row of the sink store
  sink.{i}.{t}      float32 [R, N, *slot_shape]   sink store of tensor t of layer i
  new_sink.{i}.{t}  float32 [B, min(S, N), *slot_shape]   the step's first rows unrounded;
                    the runtime keeps those at positions < N
Attention reads positions < N from the sink store (past) or unrounded (the step's own).

Per-block key scales (a layer's tensors with `per: block`, manifest `kv_cache.block_size`
fixed): those pool tensors are [num_blocks, *entry], one entry per block, quantized when
the block is full. The keys of a sequence's block still being filled are kept in float32 in
a tail store the runtime keys by block. Extra inputs and outputs:
  tail_rows          int64 [B]   the tail-store row of the block holding position
                                 context_lens[b] (the block the step continues)
  tail.{i}.{t}       float32 [R, block_size, *slot_shape]   tail store of tensor t
  new_tail.{i}.{t}   float32 [B, S, *slot_shape]   the step's rows, unrounded: the runtime
                     keeps row s at offset p % block_size of block p // block_size's row
                     (p = context_lens[b] + s)
  new_block.{i}.{t}  [B, nb, *entry]   the step's blocks, from the one holding
                     context_lens[b] on: the runtime writes block j into the pool at
                     block_tables[b][context_lens[b] // block_size + j] when the step
                     reached it; only full blocks are ever read
A query reads the keys of earlier blocks through their blocks' scales and those of its
own block unrounded.

Invariants the runtime keeps:
  - a sequence's token at position p lives at slot block_table[p // bs] * bs + p % bs;
  - the first `context_lens[b]` positions of sequence b are in the pool before the step,
    and the step's query tokens are positions context_lens[b] .. context_lens[b]+S_b-1;
  - padded query rows are garbage: their logits are never requested and their new
    entries are never written (slot -1 is skipped); their position_ids are arbitrary but
    must lie inside the graph's rotary table;

What the graph guarantees: a query attends to past position p only when
p < context_lens[b] (and inside its layer's sliding window), and to the step's own key j
only when j <= its own row index (causal by index, so right padding never leaks).
  - block 0 is a reserved null block that no sequence owns.

Sliding-window layers with their own blocks (manifest `kv_cache.layers[i].local`, blocks
layout): such a layer's pool tensors are indexed by the blocks of a second table,
  local_block_tables  int64 [B, M]   same width as block_tables; entry j names the block
                                     holding positions j*bs .. (j+1)*bs - 1 for the local
                                     layers, or block 0 once every local layer's window
                                     has passed it (the runtime freed it)
and the step's `new.{i}.*` of those layers land at the slots of that table. A freed
entry's keys are never visible (they lie outside the window), so reading block 0 there
changes nothing.

The lanes layout (manifest `kv_cache.layout: lanes`; float32 keys and values, or int8 codes
with static per-channel scales inside the graph) keeps
block tables and block ids but gives each sequence a lane: lane l owns blocks
1 + l*L .. (l+1)*L (L blocks per lane), so a sequence's positions are contiguous and a
pool tensor is [lanes, kv_heads, L * block_size, head_dim]. ONNX Runtime's
GroupQueryAttention then reads the lane where it lies and appends the step's keys and
values to it in place, with no gather, concat or scatter. Inputs (B rows = the lanes
lo .. lo+B-1; rows of lanes not in the step are idle):
  input_ids              int64 [B, S]   right-padded query tokens
  query_seqlens          int32 [B]      valid query tokens of each row (0: idle row)
  seqlens_k              int32 [B]      context_len + query_len - 1 of each row (0 if idle)
  total_sequence_length  int32 []       an upper bound of seqlens_k + 1, at least S
  logits_indices         int64 [N]      rows of the flattened [B*S] hidden states
  past.{i}.{key,value}   float32 [B, kv_heads, capacity, head_dim]   the rows' lanes
Outputs: logits, and present.{i}.{key,value}, bound to the same memory as past. Only
valid rows are written, at positions context_len .. context_len + query_len - 1.
"""

from __future__ import annotations

FORMAT_VERSION = 1

INPUT_IDS = "input_ids"
SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
QUERY_SEQLENS = "query_seqlens"
POSITION_IDS = "position_ids"
BLOCK_TABLES = "block_tables"
CONTEXT_LENS = "context_lens"
LOGITS_INDICES = "logits_indices"
LOGITS = "logits"
SINK_ROWS = "sink_rows"
TAIL_ROWS = "tail_rows"
LOCAL_BLOCK_TABLES = "local_block_tables"

NULL_BLOCK = 0


def past_name(layer: int, tensor: str) -> str:
    """Graph input holding pool tensor `tensor` of layer `layer`."""
    return f"past.{layer}.{tensor}"


def present_name(layer: int, tensor: str) -> str:
    """Lanes layout: graph output that is pool tensor `tensor` of `layer` after the step
    (bound to the same memory as its `past` input: written in place)."""
    return f"present.{layer}.{tensor}"


def attention_sums_name(layer: int) -> str:
    """Lanes layout, graphs compiled for H2O: output [B, kv_heads, total_sequence_length],
    each row's step attention weights summed over its tokens and each KV head's query
    group (compiler/attention_sums.py)."""
    return f"attention_sums.{layer}"


def present_of(past: str) -> str:
    """The lanes layout's present output bound to the same memory as input `past`."""
    return "present." + past.removeprefix("past.")


def sink_name(layer: int, tensor: str) -> str:
    """Graph input holding the sink store of tensor `tensor` of `layer`."""
    return f"sink.{layer}.{tensor}"


def new_sink_name(layer: int, tensor: str) -> str:
    """Graph output holding the step's unrounded first rows for the sink store."""
    return f"new_sink.{layer}.{tensor}"


def tail_name(layer: int, tensor: str) -> str:
    """Graph input holding the tail store (unrounded keys of unfilled blocks)."""
    return f"tail.{layer}.{tensor}"


def new_tail_name(layer: int, tensor: str) -> str:
    """Graph output holding the step's unrounded rows for the tail store."""
    return f"new_tail.{layer}.{tensor}"


def new_block_name(layer: int, tensor: str) -> str:
    """Graph output holding the step's whole-block entries of a per-block pool tensor."""
    return f"new_block.{layer}.{tensor}"


def new_name(layer: int, tensor: str) -> str:
    """Graph output holding the step's entries for pool tensor `tensor` of `layer`."""
    return f"new.{layer}.{tensor}"
