"""A Megatron-Core training state moved from TP4 to TP2 x PP2, checked against Megatron's own cut.

Four ranks hold a small GPT's training state as Megatron-Core shards it at tensor
parallel 4: bf16 parameters, fp32 master weights and both Adam moments, with the fused
``linear_qkv`` (query groups, each ``[q heads..., k, v]``), the fused SwiGLU
``linear_fc1`` (``[gate_t; up_t]`` per rank) and a vocabulary padded to Megatron's
multiple. The job changes to TP2 x PP2 (Megatron's rank order, tp fastest): nereus_comm
describes the state once with Megatron's names (:func:`nereus_comm.conventions.megatron_specs`,
fused tensors as views), plans the move (:func:`~nereus_comm.plan_reshard`) and runs it
over the job's own gloo process group (:class:`~nereus_comm.ProcessGroupTransport`).

Each destination rank then turns its shards back into Megatron's local tensors
(:func:`~nereus_comm.conventions.to_megatron`) under Megatron's per-stage names
(``decoder.layers.<local i>``, :func:`~nereus_comm.conventions.megatron_local_name`), and
every byte is compared with the shard that Megatron's convention, written out below from
the Hugging Face tensors, gives that rank at TP2 on its stage. A fused QKV whose query
groups do not divide by tp is refused (shown for tp 8 over 4 groups).

    python examples/megatron_tp_to_pp.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from nereus_comm.testing import LocalWorkers, WorkerContext

CONFIG = dict(num_layers=4, hidden=64, num_heads=8, num_kv_heads=4, ffn=96, vocab=1000)
KINDS = {"": torch.bfloat16, "master.": torch.float32}
KINDS |= {"optim.exp_avg.": torch.float32, "optim.exp_avg_sq.": torch.float32}
DIVISIBLE_BY = 128  # Megatron's make_vocab_size_divisible_by


# -- the independent reference: Megatron's shards cut from Hugging Face tensors --------------


def hf_full(prefix: str, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A deterministic full Hugging Face tensor of one kind (parameter, master, moment)."""
    g = torch.Generator().manual_seed(sum(map(ord, prefix + name)))
    return (torch.randn(shape, generator=g) * 10).to(dtype)


def hf_shapes() -> dict[str, tuple[int, ...]]:
    c = CONFIG
    h, f, v = c["hidden"], c["ffn"], c["vocab"]
    kv = c["num_kv_heads"] * (h // c["num_heads"])
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(c["num_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    return out


def megatron_local(hf: dict[str, torch.Tensor], name: str, layer: int | None, tp: int, t: int):
    """Megatron's local tensor of tp rank ``t`` for ``name`` (local layer suffix), ``layer``
    the global layer index, from the full Hugging Face tensors."""
    c = CONFIG
    head_dim = c["hidden"] // c["num_heads"]
    groups, q_per_group = c["num_kv_heads"], c["num_heads"] // c["num_kv_heads"]
    L = f"model.layers.{layer}."
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = hf["model.embed_tokens.weight" if name.startswith("emb") else "lm_head.weight"]
        padded = -(-c["vocab"] // (DIVISIBLE_BY * 4)) * DIVISIBLE_BY * 4  # padded for tp 4 and 2
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], full.shape[1])])
        rows = padded // tp
        return full[t * rows : (t + 1) * rows]
    if name == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"]
    suffix = name.split(".", 3)[3]  # after decoder.layers.<i>.
    if suffix == "input_layernorm.weight":
        return hf[L + "input_layernorm.weight"]
    if suffix == "pre_mlp_layernorm.weight":
        return hf[L + "post_attention_layernorm.weight"]
    if suffix == "self_attention.linear_qkv.weight":
        q, k, v = (hf[L + f"self_attn.{x}_proj.weight"] for x in "qkv")
        rows = []
        for g in range(t * groups // tp, (t + 1) * groups // tp):
            rows += [q[g * q_per_group * head_dim : (g + 1) * q_per_group * head_dim]]
            rows += [k[g * head_dim : (g + 1) * head_dim], v[g * head_dim : (g + 1) * head_dim]]
        return torch.cat(rows)
    if suffix == "self_attention.linear_proj.weight":
        return hf[L + "self_attn.o_proj.weight"].chunk(tp, dim=1)[t]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = hf[L + "mlp.gate_proj.weight"], hf[L + "mlp.up_proj.weight"]
        return torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
    if suffix == "mlp.linear_fc2.weight":
        return hf[L + "mlp.down_proj.weight"].chunk(tp, dim=1)[t]
    raise KeyError(name)


# -- the framework side --------------------------------------------------------------------------


def _worker(ctx: WorkerContext) -> dict:
    from nereus_comm import ProcessGroupTransport, plan_reshard, reshard
    from nereus_comm.conventions import (
        from_megatron,
        megatron_layout,
        megatron_local_name,
        megatron_specs,
        to_megatron,
    )
    from nereus_comm.optim_state import param_name

    layers = CONFIG["num_layers"]
    specs = megatron_specs(CONFIG, tp=(4, 2), with_optimizer=True, divisible_by=DIVISIBLE_BY)
    src = megatron_layout(tp=4, pp=1, dp=1, num_layers=layers)
    dst = megatron_layout(tp=2, pp=2, dp=1, num_layers=layers)
    hf = {
        prefix: {n: hf_full(prefix, n, s, dtype) for n, s in hf_shapes().items()}
        for prefix, dtype in KINDS.items()
    }

    def local_of(spec, tp: int, t: int, name: str):
        """Megatron's local tensor of tp rank t for a spec (a fused one as its view)."""
        if spec.name == "optim.step":
            return torch.tensor(7.0)
        pname = param_name(spec.name)
        prefix = spec.name[: len(spec.name) - len(pname)]
        layer = _layer(pname)
        if layer is not None:  # name may be stage-local: the global layer comes from pname
            name = pname
        local = megatron_local(hf[prefix], name, layer, tp, t)
        return from_megatron(local, spec) if _fused(spec.name) else local

    # What the TP4 run holds on this rank (Megatron's local tensors, as views).
    _, _, t = src.coords(ctx.rank)
    mine = {s.name: local_of(s, 4, t, param_name(s.name)).contiguous() for s in specs}

    transport = ProcessGroupTransport(dist.group.WORLD)
    start = time.perf_counter()
    plan = plan_reshard(specs, src, dst)
    res = reshard(plan, ctx.rank, mine, transport, timeout=60)
    seconds = time.perf_counter() - start

    # Back to Megatron: local tensors under this stage's names, checked byte for byte.
    _, stage, t = dst.coords(ctx.rank)
    bad, names = [], []
    for spec in specs:
        got = res.tensors.get(spec.name)
        if got is None:
            continue
        if spec.name == "optim.step":
            if not torch.equal(got, torch.tensor(7.0)):
                bad.append(spec.name)
            continue
        pname = param_name(spec.name)
        held_by, local_name = megatron_local_name(pname, layers, 2)
        if held_by != stage:
            bad.append(f"{spec.name} on stage {stage}, Megatron puts it on {held_by}")
            continue
        layer = _layer(pname)
        if layer is not None and _layer(local_name) != layer - stage * layers // 2:
            bad.append(f"{spec.name} is {local_name} on stage {stage}")
        names.append(spec.name.replace(pname, local_name))
        megatron_tensor = to_megatron(got) if _fused(spec.name) else got
        want = local_of(spec, 2, t, local_name)
        want = to_megatron(want) if _fused(spec.name) else want
        if megatron_tensor.shape != want.shape or not torch.equal(megatron_tensor, want):
            bad.append(spec.name)
    return {
        "bad": bad,
        "seconds": seconds,
        "bytes": (plan.stats.total_bytes, plan.stats.lower_bound_bytes),
        "held": len(names),
        "example": next(n for n in names if ".linear_qkv." in n and not n.startswith("optim")),
        "refused": _refused() if ctx.rank == 0 else None,
    }


def _fused(name: str) -> bool:
    return ".linear_qkv." in name or ".linear_fc1." in name


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("decoder.layers.") else None


def _refused() -> str:
    from nereus_comm.conventions import megatron_specs
    from nereus_comm.errors import LayoutError

    try:
        megatron_specs(CONFIG, tp=8)
    except LayoutError as e:
        return str(e)
    return "not refused"


def main() -> int:
    start = time.perf_counter()
    with LocalWorkers(4, timeout=120) as pool:
        results = pool.run(_worker)
    sent, bound = results[0]["bytes"]
    print(
        f"Megatron TP4 -> TP2 x PP2 (4 ranks, {CONFIG['num_layers']} layers, vocab "
        f"{CONFIG['vocab']} padded): {sent} B sent (lower bound {bound} B) in "
        f"{max(r['seconds'] for r in results) * 1e3:.0f} ms (slowest rank, planning included)"
    )
    for r, res in enumerate(results):
        print(f"  rank {r}: {res['held']} tensors under stage-local names, e.g. {res['example']}")
    print(f"  tp 8 over 4 query groups: {results[0]['refused']}")
    bad = {r: res["bad"] for r, res in enumerate(results) if res["bad"]}
    print(f"({time.perf_counter() - start:.1f} s in all)")
    if bad or sent != bound or "query groups" not in results[0]["refused"]:
        print(f"MISMATCH: {bad}")
        return 1
    print("every byte of every Megatron tensor on every rank: equal to Megatron's TP2 cut")
    return 0


if __name__ == "__main__":
    sys.exit(main())
