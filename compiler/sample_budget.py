"""Whether a model is small enough for a compile to sample text from it.

Sampling is sequential: every sampled token reads every weight once. That is cheap for a
small model held in memory and unaffordable at real sizes, where weights are read lazily
layer by layer (a 1B model's read costs more than a whole forward over hundreds of tokens,
and an 8B model in float32 does not fit the memory a streaming compile keeps to). Above
`SAMPLING_MAX_PARAMETERS` the quality probe measures the built-in passages and calibration
reads `calibration.text` alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free: preflight asks before anything loads
    from llmopt.compiler.ir import ArchSpec
    from llmopt.compiler.recipe import CalibrationConfig

SAMPLING_MAX_PARAMETERS = 400_000_000


def parameter_count(arch: ArchSpec) -> int:
    """The model's parameters, from its shapes alone (no weight is read)."""
    total = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    for spec in arch.layers:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        total += arch.hidden_size * (2 * q + 2 * kv + 3 * arch.intermediate_size)
    return total


def can_sample(num_parameters: int) -> bool:
    return num_parameters <= SAMPLING_MAX_PARAMETERS


def check_calibration_source(config: CalibrationConfig, num_parameters: int) -> None:
    """Refuse, in one line, calibration windows sampled from a model too large to sample."""
    if can_sample(num_parameters) or config.text and config.model_samples in ("auto", 0):
        return
    size = f"{num_parameters / 1e9:.1f}B parameters"
    if config.text is None:
        raise ValueError(f"calibration.text: a model of {size} is too large to sample "
                         "calibration windows from; set calibration.text to a UTF-8 text "
                         "file of the kind of text the model will see")
    raise ValueError(f"calibration.model_samples: a model of {size} is too large to sample "
                     "calibration windows from; leave it auto (the text alone) or set 0")
