"""library.py's ctypes Structures against kernels.c's structs, field by field."""

from __future__ import annotations

import ctypes

import pytest

from llmopt.runtime.native.library import Knobs, KVLayout, Model, QMatrix, QRows, c_layouts, kernels

lib = kernels()
MIRRORS: dict[str, type[ctypes.Structure]] = {
    "QMatrix": QMatrix, "QRows": QRows, "KVLayout": KVLayout, "Knobs": Knobs, "Model": Model}


@pytest.mark.skipif(lib is None, reason="no native kernels in this install")
def test_the_ctypes_structures_lay_out_as_the_c_structs():
    """Every struct's size and every field's offset and size are the C compiler's (the
    extension reports them, layout.c), and each side names the same fields: a field added,
    dropped or moved on one side only fails here rather than as a wrong pointer in a step."""
    layouts = c_layouts(lib)
    for name, mirror in MIRRORS.items():
        assert layouts[(name, None)] == (0, ctypes.sizeof(mirror)), name
        c_fields = [field for struct, field in layouts if struct == name and field]
        assert c_fields == [field for field, _ in mirror._fields_], name
        for field in c_fields:
            described = getattr(mirror, field)
            assert layouts[(name, field)] == (described.offset, described.size), (name, field)
    assert {struct for struct, _ in layouts} == set(MIRRORS)
