"""What `auto` means in a `kv_cache` config, per dtype: `{dtype: int4}` alone is the good int4
configuration, not the weak one.

int4 with no layout named (key_scales, group_size, value_group_size, smooth_keys) stores
keys and values with static per-channel scales (the clip searched, calibrate.py), which
the native step and ONNX Runtime's GroupQueryAttention read in place, and keeps the
layers whose cache suffers most in int8 until the whole cache's KL on calibration windows
is at most INT4_MAX_KL (sensitivity.py). The layouts that cost less at int4 alone (keys
per block, per-token groups with rotation) need the blocks KV layout: GroupQueryAttention
quantizes per tensor or per channel only, the native step per channel. Per-token int4 (the
former default) cost several times more perplexity on every text measured
(benchmarks/README.md, quality_domains.py). Other dtypes keep per-token scales and a
float32 skip dtype, as before.
"""

from __future__ import annotations

from typing import Any  # the pass's Config: not imported, the package imports this module

# The int4 default's KL target on the calibration windows (the model's own samples by
# default), chosen on quality_domains.py's tuning split: the layers it keeps in int8 held
# every text there within +5 % perplexity, which looser targets' fewer layers did not.
INT4_MAX_KL = 0.014


def resolved(config: Any) -> Any:
    """`config` with every `auto` among key_scales, value_scales, skip_dtype and max_kl set
    for its dtype (rotate's `auto` depends on the model: see `resolved_rotate`). The int4
    layout applies only where the recipe chose none (key_scales, group sizes, smoothing)."""
    default_int4 = (config.dtype == "int4" and config.key_scales == "auto"
                    and config.group_size is None and config.value_group_size is None
                    and config.smooth_keys is None)
    chosen: dict[str, Any] = {
        "key_scales": "channel" if default_int4 else "token",
        "value_scales": "channel" if default_int4 else "token",
        "skip_dtype": "int8" if default_int4 else "float32",
        "max_kl": INT4_MAX_KL if default_int4 and not (config.auto_skip or config.skip_layers)
        else None,
    }
    return config.model_copy(update={k: v for k, v in chosen.items()
                                     if getattr(config, k) == "auto"})


def max_kl_is_a_target(config: Any) -> bool:
    """An explicit max_kl must be reached (else an error names it); the default's is the
    best the layers allow."""
    return config.max_kl != "auto"
