"""Hugging Face Llama and Qwen2 checkpoints in and out of :mod:`nereus_rl.models.model`.

A checkpoint folder is ``config.json`` plus ``model.safetensors``, or several
``model-XXXXX-of-YYYYY.safetensors`` files named by ``model.safetensors.index.json``.

- :func:`hf_config`: the :class:`ModelConfig` of a folder (``LlamaForCausalLM`` and
  ``Qwen2ForCausalLM``; anything this decoder would compute differently is an error
  naming the field and the file).
- :func:`load_hf_weights`: each worker reads only the slices it holds (its pipeline
  stage's tensors, its tensor-parallel rows or columns) through safetensors'
  ``get_slice``, which maps the file and copies just those bytes.
- :func:`save_hf`: a folder that ``transformers`` loads, from the full state.
- Saving from live shards: :func:`merge_tp_shards` joins one pipeline stage's tp shards
  into full tensors, :func:`save_hf_stage` writes that stage's file, and the first
  stage's call also writes ``config.json`` and the index, which depend only on the
  config and the stage count (stage ``s`` always goes to file ``s + 1`` of ``pp``). So a
  trainer gathers each stage on one of its ranks (e.g. tp rank 0 of dp replica 0) and the
  stages write in parallel; no process ever holds more than one stage.
  :func:`merge_shards` joins every rank's shards into the full state for :func:`save_hf`.

Names: ``embed.weight`` <-> ``model.embed_tokens.weight``,
``layers.N.attn.{q,k,v,o}.{weight,bias}`` <-> ``model.layers.N.self_attn.{q,k,v,o}_proj.*``,
``layers.N.{attn_norm,mlp_norm}.weight`` <-> ``model.layers.N.{input_layernorm,
post_attention_layernorm}.weight``, ``layers.N.mlp.{gate,up,down}.weight`` <->
``model.layers.N.mlp.{gate,up,down}_proj.weight``, ``norm.weight`` <->
``model.norm.weight``, ``lm_head.weight`` <-> ``lm_head.weight``, or, tied, to
``model.embed_tokens.weight`` (a tied checkpoint stores the embedding once). A critic's
``value_head.weight`` has no counterpart: it is neither read nor written.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from nereus_rl.core.spec import SpecError
from nereus_rl.models.model import (
    Decoder,
    Llama3RopeScaling,
    ModelConfig,
    ParamSpec,
    as_model_config,
    init_full,
    shard_tensor,
    state_specs,
)
from nereus_rl.models.parallel import stage_layers

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: transformers' own default shard size for save_pretrained.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
VALUE_HEAD = "value_head.weight"

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_ARCH_CLASS = {v: k for k, v in ARCHITECTURES.items()}
# Hugging Face's defaults for fields a config.json may leave out.
_DEFAULT_MAX_POS = {"llama": 2048, "qwen2": 32768}
_DEFAULT_EPS = 1e-6

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
_DTYPE_NAMES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Casts that keep every value exactly.
_EXACT_CASTS = {
    (torch.float16, torch.float32),
    (torch.float16, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float32, torch.float64),
}
# Tensors some older checkpoints carry that hold no weights.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


class HFCheckpointError(SpecError):
    """A Hugging Face folder this model cannot read or write (names the field or tensor, and
    the file)."""


# ---------------------------------------------------------------------------- config


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise HFCheckpointError(f"{path}: not found; a Hugging Face folder needs it") from None
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path}: not valid JSON ({e})") from None


def _rope(raw: dict, file: Path) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, scaling) from either transformers 4's ``rope_theta``/``rope_scaling`` or
    transformers 5's ``rope_parameters``."""
    params = raw.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = raw.get("rope_scaling")
        field = "rope_scaling"
    params = dict(params or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta", 10000.0)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError(
            f"{file}: {field}.partial_rotary_factor={params['partial_rotary_factor']!r} is not "
            "supported (rotary embeddings here rotate the whole head)"
        )
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError(
            f"{file}: partial_rotary_factor={raw['partial_rotary_factor']!r} is not supported "
            "(rotary embeddings here rotate the whole head)"
        )
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFCheckpointError(
            f"{file}: {field} rope_type={kind!r} is not supported; supported: none/'default' "
            "and 'llama3'"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise HFCheckpointError(f"{file}: {field} (llama3) lacks {e.args[0]!r}") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise HFCheckpointError(
            f"{file}: {field} high_freq_factor={scaling.high_freq_factor} must exceed "
            f"low_freq_factor={scaling.low_freq_factor}"
        )
    return float(theta), scaling


def _config_from_dict(raw: dict, file: Path, name: str) -> ModelConfig:
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise HFCheckpointError(
            f"{file}: architectures={archs!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[archs[0]]
    if raw.get("model_type", arch) != arch:
        raise HFCheckpointError(
            f"{file}: model_type={raw['model_type']!r} does not match architectures "
            f"{archs!r} (expected {arch!r})"
        )

    def need(key: str) -> int:
        if key not in raw:
            raise HFCheckpointError(f"{file}: {key} is missing")
        v = raw[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise HFCheckpointError(f"{file}: {key}={v!r} must be a positive integer")
        return v

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if raw.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(
            f"{file}: hidden_act={raw['hidden_act']!r} is not supported (the MLP is SwiGLU: silu)"
        )
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise HFCheckpointError(
            f"{file}: head_dim={head_dim} with num_attention_heads={heads} is not hidden_size="
            f"{hidden}; a head_dim other than hidden_size / num_attention_heads is not supported"
        )
    if raw.get("attention_dropout", 0.0):
        raise HFCheckpointError(
            f"{file}: attention_dropout={raw['attention_dropout']!r} is not supported (use 0.0)"
        )
    if arch == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key, False):
                raise HFCheckpointError(
                    f"{file}: {key}=true is not supported for LlamaForCausalLM (q/k/v biases "
                    "are supported through Qwen2ForCausalLM only)"
                )
    if raw.get("use_sliding_window", False):
        raise HFCheckpointError(
            f"{file}: use_sliding_window=true is not supported (attention here is full causal)"
        )
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise HFCheckpointError(
            f"{file}: layer_types={layer_types!r} is not supported; every layer must be "
            "'full_attention'"
        )
    theta, scaling = _rope(raw, file)
    eps = raw.get("rms_norm_eps", _DEFAULT_EPS)
    try:
        return ModelConfig(
            name=name,
            num_layers=need("num_hidden_layers"),
            hidden=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            ffn_hidden=need("intermediate_size"),
            vocab=need("vocab_size"),
            max_seq_len=int(raw.get("max_position_embeddings", _DEFAULT_MAX_POS[arch])),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(eps),
            qkv_bias=arch == "qwen2",
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            arch=arch,
        )
    except SpecError as e:
        raise HFCheckpointError(f"{file}: {e}") from None


def hf_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face folder's ``config.json``.

    Arguments:
        path: the folder (or its config.json).

    Returns:
        The config, named after the folder.

    Raises:
        HFCheckpointError: a missing file or field, an architecture other than
            LlamaForCausalLM / Qwen2ForCausalLM, or a value this decoder does not compute
            (rope type other than default/llama3, partial rotary, sliding window, an
            activation other than silu, Llama's attention/mlp bias, attention dropout, a
            head_dim other than hidden/heads); the message names the field and the file.
    """
    p = Path(path)
    file = p if p.name == CONFIG_FILE else p / CONFIG_FILE
    return _config_from_dict(_read_json(file), file, file.parent.name)


def hf_config_dict(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json contents for ``config``.

    Rope settings are written as ``rope_theta`` and ``rope_scaling``, which transformers
    4 reads and transformers 5 converts (5's ``rope_parameters`` alone is lost on 4).
    """
    c = as_model_config(config)
    dtype_name = str(dtype).removeprefix("torch.")
    out = {
        "architectures": [_ARCH_CLASS[c.arch]],
        "model_type": c.arch,
        "hidden_size": c.hidden,
        "intermediate_size": c.ffn_hidden,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab,
        "max_position_embeddings": c.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": dtype_name,
        "use_cache": True,
    }
    if c.rope_scaling is not None:
        s = c.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if c.arch == "llama":
        if c.qkv_bias:
            raise HFCheckpointError(
                f"model {c.name!r}: qkv_bias=True has no LlamaForCausalLM form (Llama's "
                "attention_bias also biases o_proj); use arch='qwen2'"
            )
        out.update(attention_bias=False, mlp_bias=False)
    else:
        if not c.qkv_bias:
            raise HFCheckpointError(
                f"model {c.name!r}: Qwen2ForCausalLM always has q/k/v biases; set qkv_bias=True"
            )
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
    return out


# ---------------------------------------------------------------------------- names


def hf_name(name: str, config: ModelConfig) -> str | None:
    """The checkpoint tensor holding our tensor ``name`` (None: no counterpart)."""
    c = as_model_config(config)
    if name == "embed.weight" or (name == "lm_head.weight" and c.tie_embeddings):
        return "model.embed_tokens.weight"
    if name in ("norm.weight", "lm_head.weight"):
        return name if name == "lm_head.weight" else "model.norm.weight"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None:
        return None
    i, rest = m.groups()
    part = {
        "attn_norm.weight": "input_layernorm.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
    }.get(rest)
    if part is None:
        m2 = re.fullmatch(r"(attn|mlp)\.(\w+)\.(weight|bias)", rest)
        if m2 is None:
            return None
        block, proj, kind = m2.groups()
        part = f"{'self_attn' if block == 'attn' else 'mlp'}.{proj}_proj.{kind}"
    return f"model.layers.{i}.{part}"


def _expected_hf_names(config: ModelConfig) -> set[str]:
    names = {hf_name(s.name, config) for s in state_specs(config)}
    names.discard(None)
    return names  # type: ignore[return-value]


# ---------------------------------------------------------------------------- load


def _weight_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the file holding it (reads headers only)."""
    index = folder / INDEX_FILE
    if index.exists():
        raw = _read_json(index)
        weight_map = raw.get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFCheckpointError(f"{index}: weight_map is missing")
        return {k: folder / v for k, v in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.exists():
        raise HFCheckpointError(
            f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} is there (only safetensors "
            "checkpoints are read)"
        )
    with _open(single) as f:
        return {k: single for k in f.keys()}


def _open(file: Path):
    """``safe_open`` of a weight file; a file that is not safetensors is an error naming it."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _local_range(n: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    rows = n // tp_size
    return tp_rank * rows, (tp_rank + 1) * rows


def _target_dtype(have: torch.dtype, want: torch.dtype, name: str, file: Path, cast: bool):
    if have == want or (have, want) in _EXACT_CASTS or cast:
        return
    raise HFCheckpointError(
        f"tensor {name} in {file} is {have}; loading it as {want} would round it (pass "
        f"cast=True to accept that, or load into a {have} model)"
    )


def read_hf_shards(
    path: str | os.PathLike,
    specs: Sequence[ParamSpec],
    config: ModelConfig,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    cast: bool = False,
    read: bool = True,
) -> dict[str, torch.Tensor]:
    """Read this tp rank's shards of ``specs`` from a checkpoint folder.

    Only the requested slices are read (``safe_open(...).get_slice``). Each shard comes
    back contiguous, in its spec's dtype.

    Arguments:
        path: the folder.
        specs: the full-state specs this rank holds (e.g. ``Decoder.local_specs()``); a
            spec with no checkpoint counterpart (a critic's value head) is skipped.
        config: the model these specs describe (for the names and the checks).
        tp_rank, tp_size: this rank's tensor-parallel coordinates.
        cast: allow a cast that rounds (e.g. fp32 checkpoint into a bf16 model).
        read: False checks every tensor's name, shape and dtype from the files' headers
            and reads no data (returns an empty dict).

    Raises:
        HFCheckpointError: a missing weight file or tensor, an unreadable file; a tensor
            the config does not know (e.g. a layer past ``num_hidden_layers``); a tensor
            whose shape differs from the config's or whose dtype differs from
            config.json's ``torch_dtype`` / ``dtype``; a rounding cast without ``cast``.
            Messages name the tensor and file.
    """
    folder = Path(path)
    if folder.name == CONFIG_FILE:
        folder = folder.parent
    raw = _read_json(folder / CONFIG_FILE)
    declared_name = raw.get("dtype") or raw.get("torch_dtype")
    declared = _DTYPE_NAMES.get(declared_name) if isinstance(declared_name, str) else None
    files = _weight_files(folder)
    expected = _expected_hf_names(config)
    extra = sorted(n for n in files if n not in expected and not _IGNORED.match(n))
    # A tied checkpoint may still carry a copy of the head; it is not read.
    if as_model_config(config).tie_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")
    if extra:
        raise HFCheckpointError(
            f"tensor {extra[0]} in {files[extra[0]]} is not a weight of this config "
            f"({len(extra)} such: {extra[:4]}); check num_hidden_layers and the architecture "
            f"in {folder / CONFIG_FILE}"
        )
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        for spec in specs:
            name = hf_name(spec.name, config)
            if name is None:
                continue
            if name not in files:
                where = folder / (INDEX_FILE if (folder / INDEX_FILE).exists() else SINGLE_FILE)
                raise HFCheckpointError(f"tensor {name} is missing from {where}")
            file = files[name]
            if file not in handles:
                if not file.exists():
                    raise HFCheckpointError(f"{file}: not found (named for {name})")
                handles[file] = stack.enter_context(_open(file))
            sl = handles[file].get_slice(name)
            shape = tuple(sl.get_shape())
            if shape != tuple(spec.shape):
                raise HFCheckpointError(
                    f"tensor {name} in {file} has shape {shape}; {folder / CONFIG_FILE} "
                    f"implies {tuple(spec.shape)}"
                )
            have = _DTYPES.get(sl.get_dtype())
            if have is None:
                raise HFCheckpointError(
                    f"tensor {name} in {file} has dtype {sl.get_dtype()}; supported: "
                    f"{sorted(_DTYPES)}"
                )
            if declared is not None and have != declared:
                raise HFCheckpointError(
                    f"tensor {name} in {file} is {have}, but {folder / CONFIG_FILE} declares "
                    f"dtype {declared_name!r}"
                )
            _target_dtype(have, spec.dtype, name, file, cast)
            if spec.split_dim is not None and shape[spec.split_dim] % tp_size:
                raise HFCheckpointError(
                    f"tensor {name} in {file}: dim {spec.split_dim} of {shape} does not divide "
                    f"by tp={tp_size}"
                )
            if not read:
                continue
            if spec.split_dim is None or tp_size == 1:
                t = sl[:]
            else:
                a, b = _local_range(shape[spec.split_dim], tp_rank, tp_size)
                t = sl[a:b] if spec.split_dim == 0 else sl[:, a:b]
            out[spec.name] = t.to(spec.dtype).contiguous()
    return out


_COMPARED = (
    "num_layers",
    "hidden",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden",
    "vocab",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "qkv_bias",
    "tie_embeddings",
)


def load_hf_weights(
    target: Decoder | Sequence[ParamSpec],
    path: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    cast: bool = False,
) -> dict[str, torch.Tensor]:
    """Load a Hugging Face checkpoint's weights into a Decoder stage, or read them for specs.

    Arguments:
        target: a :class:`Decoder` (its tp coordinates, stage and dtypes are used, and its
            parameters are set; a critic keeps its value head), or full-state specs
            (e.g. ``state_specs(...)`` filtered to a stage) with ``tp_rank``/``tp_size``.
        path: the folder.
        config: the model's config (default: the Decoder's, or the folder's).
        tp_rank, tp_size: for specs only.
        cast: allow a cast that rounds.

    Returns:
        The shards read, by full-state name.

    Raises:
        HFCheckpointError: see :func:`read_hf_shards`; or the folder's config.json
            describes another model than the Decoder's config (the differing fields).
    """
    folder_config = hf_config(path)
    if isinstance(target, Decoder):
        config = as_model_config(config or target.config)
        diff = [
            f"{f}: {getattr(folder_config, f)!r} in the folder, {getattr(config, f)!r} here"
            for f in _COMPARED
            if getattr(folder_config, f) != getattr(config, f)
        ]
        if diff:
            raise HFCheckpointError(
                f"{Path(path) / CONFIG_FILE} describes another model than {config.name!r}: "
                + "; ".join(diff)
            )
        g = target.groups
        state = read_hf_shards(
            path, target.local_specs(), config, tp_rank=g.tp_rank, tp_size=g.tp_size, cast=cast
        )
        target.load_shard_state_dict(state, strict=not target.is_critic)
        return state
    return read_hf_shards(
        path, target, config or folder_config, tp_rank=tp_rank, tp_size=tp_size, cast=cast
    )


def check_hf_weights(path: str | os.PathLike, config: ModelConfig) -> None:
    """Check a folder's weights against ``config`` from the files' headers alone: every
    tensor present, none extra, shapes and dtypes right. Reads no tensor data.

    Raises:
        HFCheckpointError: as :func:`read_hf_shards`, naming the tensor and the file.
    """
    read_hf_shards(path, state_specs(config), config, read=False)


@dataclass(frozen=True)
class HFWeights:
    """A model's initial weights as a Hugging Face folder, in place of its full tensors.

    The trainer hands this to its workers instead of the state: each worker reads only
    the slices its stage holds (:meth:`shards`), so the folder must be readable at
    ``path`` on every worker's machine. A tensor the checkpoint has no counterpart for (a
    critic's value head) starts from the seed's initial value, the same on every layout.

    Attributes:
        path: the folder.
        seed: the seed of the tensors the folder lacks.
    """

    path: str
    seed: int = 0

    def shards(self, model: Decoder) -> dict[str, torch.Tensor]:
        """``model``'s shards (its stage, its tp rank) by full-state name, in its dtype.

        Raises:
            HFCheckpointError: see :func:`read_hf_shards`.
        """
        g = model.groups
        specs = model.local_specs()
        cfg = as_model_config(model.config)
        out = read_hf_shards(self.path, specs, cfg, tp_rank=g.tp_rank, tp_size=g.tp_size)
        for spec in specs:
            if spec.name not in out:
                full = init_full(spec, self.seed, cfg.num_layers).to(spec.dtype)
                out[spec.name] = shard_tensor(full, spec.split_dim, g.tp_rank, g.tp_size)
        return out


# ---------------------------------------------------------------------------- save


def merge_tp_shards(
    shards: Sequence[Mapping[str, torch.Tensor]], specs: Sequence[ParamSpec]
) -> dict[str, torch.Tensor]:
    """Full tensors from the tp shards of one pipeline stage.

    Arguments:
        shards: each tp rank's ``shard_state_dict()``, in tp-rank order.
        specs: the stage's full-state specs (the names merged; others are ignored).

    Returns:
        Full tensors by name: split tensors concatenated on their split dim, replicated
        ones taken from rank 0 (they are checked equal on every rank).

    Raises:
        ValueError: a rank lacks a tensor, a concatenation does not give the spec's
            shape, or a replicated tensor differs between ranks.
    """
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        parts = []
        for r, shard in enumerate(shards):
            if spec.name not in shard:
                raise ValueError(f"tp rank {r}'s shards lack {spec.name}")
            parts.append(shard[spec.name].detach())
        if spec.split_dim is None:
            if any(not torch.equal(parts[0], p) for p in parts[1:]):
                raise ValueError(f"{spec.name} is replicated but differs between tp ranks")
            full = parts[0]
        else:
            full = torch.cat(parts, dim=spec.split_dim)
        if tuple(full.shape) != tuple(spec.shape):
            raise ValueError(
                f"{spec.name}: {len(shards)} tp shards make {tuple(full.shape)}, the model's "
                f"tensor is {tuple(spec.shape)}"
            )
        out[spec.name] = full
    return out


def merge_shards(
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
    config: ModelConfig,
    *,
    value_head: bool = False,
) -> dict[str, torch.Tensor]:
    """The full state from every rank's shards of one data-parallel replica.

    Arguments:
        shards: ``(pp_rank, tp_rank) -> shard_state_dict()`` for all pp x tp ranks.
        config: the model.
        value_head: the critic variant.

    Raises:
        ValueError: a rank is missing, or see :func:`merge_tp_shards`.
    """
    pp = 1 + max(p for p, _ in shards)
    tp = 1 + max(t for _, t in shards)
    missing = [(p, t) for p in range(pp) for t in range(tp) if (p, t) not in shards]
    if missing:
        raise ValueError(f"shards of (pp_rank, tp_rank) {missing} are missing")
    specs = state_specs(config, value_head=value_head)
    out: dict[str, torch.Tensor] = {}
    for p in range(pp):
        held = [s for s in specs if s.name in shards[(p, 0)]]
        out.update(merge_tp_shards([shards[(p, t)] for t in range(tp)], held))
    absent = [s.name for s in specs if s.name not in out]
    if absent:
        raise ValueError(f"no rank holds {absent[:4]}")
    return out


def _hf_tensors(
    state: Mapping[str, torch.Tensor], specs: Sequence[ParamSpec], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our full tensors -> checkpoint names (a tied head is checked, then dropped)."""
    c = as_model_config(config)
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        name = hf_name(spec.name, c)
        if name is None or spec.name not in state:
            continue
        t = state[spec.name].detach()
        if tuple(t.shape) != tuple(spec.shape):
            raise ValueError(f"{spec.name}: shape {tuple(t.shape)}, the config's is {spec.shape}")
        if name in out:  # the tied head: same checkpoint tensor as the embedding
            if not torch.equal(out[name], t.to(out[name].dtype)):
                raise ValueError(
                    "lm_head.weight differs from embed.weight, but the config ties them; a "
                    "tied checkpoint stores one of them"
                )
            continue
        out[name] = t.contiguous().cpu()
    return out


def _write_safetensors(file: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    # transformers refuses files without format=pt in their metadata.
    tmp = file.with_name(file.name + ".tmp")
    save_file(dict(tensors), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, file)


def _write_json(file: Path, obj: dict) -> None:
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, file)


def _file_name(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _state_dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"tensors of several dtypes {sorted(map(str, dtypes))}; cast them to one")
    return dtypes.pop()


def save_hf(
    path: str | os.PathLike,
    state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write a Hugging Face folder (config.json + safetensors) from the full state.

    Arguments:
        path: the folder (created if needed; files of the same names are replaced).
        state: full tensors by our names (a policy's; a value head is not written), all of
            one dtype, which becomes config.json's ``torch_dtype``. :func:`merge_shards`
            builds it from shards.
        config: the model.
        max_shard_bytes: above this, tensors go to several files (in state order) with a
            ``model.safetensors.index.json``.

    Returns:
        The files written.

    Raises:
        ValueError: a missing tensor, a wrong shape, mixed dtypes, or a tied head that
            differs from the embedding.
        HFCheckpointError: the config has no Llama/Qwen2 form (see :func:`hf_config_dict`).
    """
    c = as_model_config(config)
    specs = state_specs(c)
    absent = [s.name for s in specs if s.name not in state]
    if absent:
        raise ValueError(f"the state lacks {absent[:4]}; save_hf needs the full policy state")
    tensors = _hf_tensors(state, specs, c)
    dtype = _state_dtype(tensors)
    meta = hf_config_dict(c, dtype)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    return _write_folder(Path(path), groups, meta, range(len(groups)))


def _write_folder(folder: Path, groups, meta: dict, which) -> list[Path]:
    """Write files ``which`` of ``groups``; the caller holding file 0 writes the metadata
    (config.json, and the index when there are several files)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(groups)
    written = []
    for i in which:
        file = folder / _file_name(i, n)
        _write_safetensors(file, groups[i])
        written.append(file)
    if 0 in which:
        if n > 1:
            index = {
                "metadata": {
                    "total_size": sum(
                        t.numel() * t.element_size() for g in groups for t in g.values()
                    )
                },
                "weight_map": {k: _file_name(i, n) for i, g in enumerate(groups) for k in g},
            }
            _write_json(folder / INDEX_FILE, index)
            written.append(folder / INDEX_FILE)
        else:
            # A stale index would point transformers at files of another save.
            (folder / INDEX_FILE).unlink(missing_ok=True)
        _write_json(folder / CONFIG_FILE, meta)
        written.append(folder / CONFIG_FILE)
    return written


def save_hf_stage(
    path: str | os.PathLike,
    stage_state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    *,
    stage: int,
    num_stages: int,
    value_head: bool = False,
) -> list[Path]:
    """Write one pipeline stage's file of a Hugging Face folder (one file per stage).

    Each stage's writer calls this with its stage's full tensors (e.g.
    :func:`merge_tp_shards` of its tp group's shards); stage 0's call also writes
    config.json and the index, computed from the config alone, so the stages need not
    exchange anything. The folder is complete once every stage has written. With one
    stage it is :func:`save_hf` with a single file.

    Arguments:
        path: the folder.
        stage_state: full tensors of the stage's parameters by our names (all of one
            dtype).
        config: the model.
        stage, num_stages: this stage and the pipeline degree (the file is
            ``model-{stage+1:05d}-of-{num_stages:05d}.safetensors``).
        value_head: the state is a critic's: the folder is a ``LlamaForTokenClassification``
            / ``Qwen2ForTokenClassification`` with one label, whose ``score`` (the value
            head, with a zero bias) gives the critic's values. Without it a value head in
            the state is skipped.

    Returns:
        The files written.

    Raises:
        ValueError: the state does not hold exactly the stage's tensors, or see
            :func:`save_hf`.
    """
    c = as_model_config(config)
    layers = set(stage_layers(c.num_layers, num_stages, stage))
    specs = state_specs(c, value_head=value_head)
    # A stage's tensors: its layers' (the embedding counts as layer 0 and the head and
    # final norm as the last layer, as everywhere in the state specs).
    per_stage = [
        [s for s in specs if s.layer in set(stage_layers(c.num_layers, num_stages, p))]
        for p in range(num_stages)
    ]
    mine = [s for s in specs if s.layer in layers]
    want = {s.name for s in mine}
    have = set(stage_state) if value_head else {k for k in stage_state if k != VALUE_HEAD}
    if have != want:
        raise ValueError(
            f"stage {stage} of {num_stages} holds {sorted(want)[:4]}...; got missing "
            f"{sorted(want - have)[:4]} unexpected {sorted(have - want)[:4]}"
        )
    tensors = _hf_tensors(stage_state, mine, c)
    if VALUE_HEAD in want:
        head = stage_state[VALUE_HEAD].detach()
        tensors["score.weight"] = head.contiguous().cpu()
        tensors["score.bias"] = torch.zeros(1, dtype=head.dtype)
    if c.tie_embeddings and stage != 0:
        # The tied head is written once, by the first stage (as embed_tokens).
        tensors.pop("model.embed_tokens.weight", None)
    dtype = _state_dtype(tensors)
    # The other stages' tensors are only named and sized here, never touched.
    groups: list[dict] = []
    for p, stage_specs in enumerate(per_stage):
        if p == stage:
            groups.append(tensors)
            continue
        named: dict[str, _Sized] = {}
        for s in stage_specs:
            if s.name == VALUE_HEAD:
                named["score.weight"] = _Sized(s.shape, dtype)
                named["score.bias"] = _Sized((1,), dtype)
                continue
            name = hf_name(s.name, c)
            if name is None or (c.tie_embeddings and s.name == "lm_head.weight" and p != 0):
                continue
            named[name] = _Sized(s.shape, dtype)
        groups.append(named)
    meta = hf_config_dict(c, dtype)
    if value_head:
        meta.update(
            architectures=[_ARCH_CLASS[c.arch].replace("ForCausalLM", "ForTokenClassification")],
            num_labels=1,
            id2label={"0": "LABEL_0"},
            label2id={"LABEL_0": 0},
            # the critic has no output embedding to tie
            tie_word_embeddings=False,
        )
    return _write_folder(Path(path), groups, meta, [stage])


class _Sized:
    """A tensor's size without its data (for another stage's entries in the index)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = shape
        self._itemsize = torch.empty((), dtype=dtype).element_size()

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self._itemsize
