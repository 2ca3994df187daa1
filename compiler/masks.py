"""The attention masks of the blocks layout, built once per step in the graph: which keys
each query may see (context length, causality, sliding window), sink positions, and the
per-block key scales' step blocks."""

from __future__ import annotations

import numpy as np

from llmopt.compiler.onnx_graph import GraphBuilder
from llmopt.runtime import contract as C

NEG_INF = np.float32(-np.inf)


def additive_mask(g: GraphBuilder, past_len: str, window: int | None) -> str:
    """Additive mask [B, 1, S, L] over the gathered past and the step's keys."""
    allowed = AllowedKeys(g, past_len).build(window)
    bias = g.op("Where", [allowed, g.const(0.0, np.float32), g.const(NEG_INF, np.float32)])
    return g.op("Unsqueeze", [bias, g.const([1])], name="mask")


def sink_mask(g: GraphBuilder, past_len: str, sinks: int) -> str:
    """Which of the keys attention reads are sink positions, [B, Lp + S, 1]."""
    past_pos = g.op("Range", [g.const(0), g.op("Squeeze", [past_len]), g.const(1)])
    batch = g.op("Shape", [C.POSITION_IDS], start=0, end=1)
    past_pos = g.op("Expand", [past_pos, g.op("Concat", [batch, past_len], axis=0)])
    positions = g.op("Concat", [past_pos, C.POSITION_IDS], axis=1)  # [B, Lp + S]
    return g.op("Less", [g.op("Unsqueeze", [positions, g.const([2])]), g.const(sinks)],
                name="is_sink")


class AllowedKeys:
    """Which keys each query may see, [B, S, L] bool, L = gathered past + step tokens.

    Past key p (its position, since blocks hold a sequence in order) is visible when
    p < context_len and inside the window; the step's key j is visible to query i when
    j <= i (index causality, so right padding never leaks) and inside the window.
    """

    def __init__(self, g: GraphBuilder, past_len: str):
        self.g, self.past_len = g, past_len

    def build(self, window: int | None) -> str:
        g = self.g
        q_pos = g.op("Unsqueeze", [C.POSITION_IDS, g.const([2])])  # [B, S, 1]
        past = self._past(q_pos, window)
        new = self._new(q_pos, window)
        return g.op("Concat", [past, new], axis=2, name="allowed")

    def _past(self, q_pos: str, window: int | None) -> str:
        g = self.g
        length = g.op("Squeeze", [self.past_len])
        k_pos = g.op("Range", [g.const(0), length, g.const(1)])  # [Lp]
        ctx = g.op("Unsqueeze", [C.CONTEXT_LENS, g.const([1, 2])])  # [B, 1, 1]
        allowed = g.op("Less", [k_pos, ctx])  # [B, 1, Lp]
        if window is not None:
            allowed = g.op("And", [allowed, self._in_window(q_pos, k_pos, window)])
        return self._expand(allowed, q_pos, length)

    def _new(self, q_pos: str, window: int | None) -> str:
        g = self.g
        seq = g.op("Squeeze", [g.op("Shape", [C.INPUT_IDS], start=1, end=2)])
        index = g.op("Range", [g.const(0), seq, g.const(1)])
        causal = g.op("LessOrEqual", [index, g.op("Unsqueeze", [index, g.const([1])])])  # [S, S]
        if window is not None:
            k_pos = g.op("Unsqueeze", [C.POSITION_IDS, g.const([1])])  # [B, 1, S]
            causal = g.op("And", [causal, self._in_window(q_pos, k_pos, window)])
        return self._expand(causal, q_pos, seq)

    def _in_window(self, q_pos: str, k_pos: str, window: int) -> str:
        distance = self.g.op("Sub", [q_pos, k_pos])
        return self.g.op("Less", [distance, self.g.const(window)])

    def _expand(self, mask: str, q_pos: str, length: str) -> str:
        """Broadcast to [B, S, length] so the two halves concatenate."""
        g = self.g
        batch_seq = g.op("Shape", [C.POSITION_IDS])
        shape = g.op("Concat", [batch_seq, g.op("Unsqueeze", [length, g.const([0])])], axis=0)
        return g.op("Expand", [mask, shape])



class StepBlocks:
    """Where a step's blocks come from, and what each query sees, for per-block key scales.

    Sequence b continues block c_b = context_lens[b] // bs, of which t_b = context_lens[b]
    % bs rows are in the tail store. The step's blocks are A = ceil((max t + S) / bs) * bs
    positions from c_b * bs: row a is the tail's row a (a < t_b) or the step's row a - t_b.
    Keys are laid out [past M * bs | step blocks read back (A) | step blocks unrounded (A)].
    """

    def __init__(self, g: GraphBuilder, block_size: int, past_len: str):
        self.g, self.bs, self.past_len = g, block_size, past_len
        bs = g.const(block_size)
        ctx = C.CONTEXT_LENS
        self.t = g.op("Mod", [ctx, bs])  # [B] rows of the continued block in the tail
        self.start = g.op("Sub", [ctx, self.t])  # [B] its first position
        self.seq = g.op("Shape", [C.INPUT_IDS], start=1, end=2)  # [1]
        rows = g.op("Add", [g.op("ReduceMax", [self.t], keepdims=1), self.seq])
        blocks = g.op("Div", [g.op("Add", [rows, g.const([block_size - 1])]), bs])
        self.length = g.op("Mul", [blocks, bs])  # [1] A
        a = g.op("Range", [g.const(0), g.op("Squeeze", [self.length]), g.const(1)])
        self.a = g.op("Unsqueeze", [a, g.const([0])])  # [1, A]
        t = g.op("Unsqueeze", [self.t, g.const([1])])  # [B, 1]
        in_tail = g.op("Less", [self.a, t])  # [B, A]
        from_step = g.op("Sub", [self.a, t])  # the step's row, where not in the tail
        self.key_index = self._rows(g.op("Where", [in_tail, self.a, g.op("Add", [
            from_step, bs])]), g.op("Add", [self.seq, bs]))  # into [tail (bs) | step (S)]
        start = g.op("Unsqueeze", [self.start, g.const([1])])
        self.value_index = self._rows(g.op("Where", [in_tail, g.op("Add", [start, self.a]),
                                                     g.op("Add", [from_step, self.past_len])]),
                                      g.op("Add", [self.past_len, self.seq]))
        self._masks: dict[int | None, str] = {}

    def _rows(self, index: str, length: str) -> str:
        """[B, A] row indices clipped into [0, length) as GatherND's [B, A, 1]."""
        g = self.g
        last = g.op("Sub", [length, g.const([1])])
        clipped = g.op("Min", [g.op("Max", [index, g.const(0)]), last])
        return g.op("Unsqueeze", [clipped, g.const([2])])

    def aligned(self, x: str, index: str) -> str:
        """x [B, L, W] gathered into the step's blocks, [B, A, W]."""
        return self.g.op("GatherND", [x, index], batch_dims=1)

    def mask(self, window: int | None) -> str:
        """Additive [B, 1, S, M * bs + 2A], built once per window size."""
        if window not in self._masks:
            g = self.g
            q_pos = g.op("Unsqueeze", [C.POSITION_IDS, g.const([2])])  # [B, S, 1]
            start = g.op("Unsqueeze", [self.start, g.const([1, 2])])  # [B, 1, 1]
            past_len = g.op("Squeeze", [self.past_len])
            k_pos = g.op("Range", [g.const(0), past_len, g.const(1)])  # [Lp]
            past = g.op("Less", [k_pos, start])  # complete blocks before the step's
            a_pos = g.op("Add", [start, g.op("Unsqueeze", [self.a, g.const([0])])])  # [B,1,A]
            causal = g.op("LessOrEqual", [a_pos, q_pos])  # [B, S, A]
            block = g.const(self.bs)
            earlier = g.op("Less", [g.op("Div", [a_pos, block]), g.op("Div", [q_pos, block])])
            read = g.op("And", [causal, earlier])
            unrounded = g.op("And", [causal, g.op("Not", [earlier])])
            if window is not None:
                past = g.op("And", [past, self._in_window(q_pos, k_pos, window)])
                in_window = self._in_window(q_pos, a_pos, window)
                read = g.op("And", [read, in_window])
                unrounded = g.op("And", [unrounded, in_window])
            shape = g.op("Concat", [g.op("Shape", [C.POSITION_IDS]), self.past_len], axis=0)
            allowed = g.op("Concat", [g.op("Expand", [past, shape]), read, unrounded], axis=2)
            bias = g.op("Where", [allowed, g.const(0.0, np.float32), g.const(NEG_INF, np.float32)])
            self._masks[window] = g.op("Unsqueeze", [bias, g.const([1])], name="block_mask")
        return self._masks[window]

    def _in_window(self, q_pos: str, k_pos: str, window: int) -> str:
        return self.g.op("Less", [self.g.op("Sub", [q_pos, k_pos]), self.g.const(window)])

