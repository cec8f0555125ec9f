"""Models trained by lightning_islands."""

from lightning_islands.models.moe import (
    PRESETS,
    Block,
    CausalSelfAttention,
    MoEConfig,
    MoELanguageModel,
    MoELayer,
    MoETransformer,
    SwiGLU,
    apply_rope,
    count_parameters,
    lr_schedule,
    rope_tables,
)
from lightning_islands.models.parallelize import parallelize_moe

__all__ = [
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "MoEConfig",
    "MoELanguageModel",
    "MoELayer",
    "MoETransformer",
    "SwiGLU",
    "apply_rope",
    "count_parameters",
    "lr_schedule",
    "parallelize_moe",
    "rope_tables",
]
