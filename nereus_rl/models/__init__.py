"""The model the trainer runs: a Llama/Qwen2-style decoder with tensor, pipeline and data
parallelism, and generation with a KV cache.

:mod:`.model` (``Decoder``, ``ModelConfig``, presets, state specs and sharding),
:mod:`.parallel` (process groups and the tensor-parallel collectives), :mod:`.pipeline`
(pipeline-parallel forward and backward), :mod:`.generate` (sampling). Imports only
``nereus_rl.core`` of nereus_rl (for the model specs); the trainer and ``data`` use it.
"""

from nereus_rl.models.generate import (
    GenerationOutput,
    KVCache,
    generate,
    make_generator,
    make_row_generators,
)
from nereus_rl.models.model import (
    PRESETS,
    Decoder,
    ModelConfig,
    ParamSpec,
    ShardStateError,
    UnknownPresetError,
    check_tp_divisible,
    get_preset,
    shard_tensor,
    state_specs,
)
from nereus_rl.models.parallel import (
    ParallelGroups,
    allreduce_gradients,
    init_parallel_groups,
    response_logprobs,
    response_values,
    stage_layers,
    vocab_parallel_argmax,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from nereus_rl.models.pipeline import pipeline_forward, pipeline_forward_backward

__all__ = [
    "PRESETS",
    "Decoder",
    "GenerationOutput",
    "KVCache",
    "ModelConfig",
    "ParallelGroups",
    "ParamSpec",
    "ShardStateError",
    "UnknownPresetError",
    "allreduce_gradients",
    "check_tp_divisible",
    "generate",
    "get_preset",
    "init_parallel_groups",
    "make_generator",
    "make_row_generators",
    "pipeline_forward",
    "pipeline_forward_backward",
    "response_logprobs",
    "response_values",
    "shard_tensor",
    "stage_layers",
    "state_specs",
    "vocab_parallel_argmax",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]
