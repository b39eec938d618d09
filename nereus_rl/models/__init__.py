"""The model the trainer runs: a Llama/Qwen2-style decoder with tensor, pipeline and data
parallelism, and generation with a KV cache.

:mod:`.model` (``Decoder``, ``ModelConfig``, presets, state specs and sharding),
:mod:`.parallel` (process groups and the tensor-parallel collectives), :mod:`.pipeline`
(pipeline-parallel forward and backward), :mod:`.generate` (sampling), :mod:`.hf`
(Hugging Face Llama/Qwen2 checkpoints in and out; needs ``safetensors`` when called). Imports only
``nereus_rl.core`` of nereus_rl (for the model specs); the trainer and ``data`` use it.
"""

from nereus_rl.models.generate import (
    GenerationOutput,
    KVCache,
    generate,
    left_pad,
    make_generator,
    make_row_generators,
)
from nereus_rl.models.hf import (
    HFCheckpointError,
    HFWeights,
    check_hf_weights,
    hf_config,
    load_hf_weights,
    merge_shards,
    merge_tp_shards,
    read_hf_shards,
    save_hf,
    save_hf_stage,
)
from nereus_rl.models.model import (
    PRESETS,
    Decoder,
    Llama3RopeScaling,
    ModelConfig,
    ParamSpec,
    ShardStateError,
    UnknownPresetError,
    allreduce_tied_gradients,
    as_model_config,
    attention_bias,
    check_tp_divisible,
    full_attention_mask,
    get_preset,
    position_ids,
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
    "HFCheckpointError",
    "HFWeights",
    "KVCache",
    "Llama3RopeScaling",
    "ModelConfig",
    "ParallelGroups",
    "ParamSpec",
    "ShardStateError",
    "UnknownPresetError",
    "allreduce_gradients",
    "allreduce_tied_gradients",
    "as_model_config",
    "attention_bias",
    "check_hf_weights",
    "check_tp_divisible",
    "full_attention_mask",
    "generate",
    "get_preset",
    "hf_config",
    "init_parallel_groups",
    "left_pad",
    "load_hf_weights",
    "make_generator",
    "make_row_generators",
    "merge_shards",
    "merge_tp_shards",
    "pipeline_forward",
    "pipeline_forward_backward",
    "position_ids",
    "read_hf_shards",
    "response_logprobs",
    "response_values",
    "save_hf",
    "save_hf_stage",
    "shard_tensor",
    "stage_layers",
    "state_specs",
    "vocab_parallel_argmax",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]
