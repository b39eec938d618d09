"""Rollout generation throughput: nereus_rl's generation against transformers' generate.

The same model (a random LlamaForCausalLM built by transformers, saved to a temporary
folder and loaded into nereus_rl's Decoder with ``load_hf_weights``; nothing is
downloaded), the same batch of variable-length prompts (left-padded, with their
attention mask), the same number of new tokens (no EOS: every row runs the whole
length), greedy and sampled (temperature 1, no top-k or top-p: the distribution
nereus_rl samples), on CPU, with the KV cache, side by side in one process at batch 1,
8 and 32.

nereus_rl generates as the trainer's rollout does (``rl.generate``): one sampling
generator per row (``make_row_generators``), so that any data-parallel split samples
alike. Both run with the same torch thread count (``--threads``, 1 by default: one
worker per core, as the trainer's workers run).

Timing: after a warm-up of each, the two alternate, ``--repeats`` times each, and each
figure is its fastest run (on a shared machine other work only ever adds time; the
alternation spreads slow phases over both alike); the medians are recorded beside
(``*_median_tok_s``). Tokens per second counts the generated tokens, batch x new
tokens. Greedy outputs are checked token for token against transformers'
(``greedy_equal``).

Goal (issue 27): at least 1.0x transformers at batch 1, at least 1.5x at batch 8 and up.

    python benchmarks/bench_rollout.py --quick --json out.json   # under 2 minutes
    python benchmarks/bench_rollout.py --json full.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nereus_rl.data.tokenizers import import_transformers
from nereus_rl.models.generate import generate, left_pad, make_row_generators
from nereus_rl.models.hf import hf_config, load_hf_weights
from nereus_rl.models.model import Decoder

#: The goal's ratio (nereus_rl / transformers tokens/s) by the smallest batch it covers.
GOALS = {1: 1.0, 8: 1.5}

SIZES = {
    # a model small enough that a CPU run is dominated by what generation does around
    # the matrix products, as a rollout of a small policy is
    "quick": dict(
        hidden=128, layers=2, heads=4, kv_heads=2, ffn=344, vocab=1024,
        prompt=(8, 24), new_tokens=24, batches=(1, 8, 32), repeats=5,
    ),
    "full": dict(
        hidden=256, layers=4, heads=8, kv_heads=4, ffn=688, vocab=4096,
        prompt=(16, 64), new_tokens=64, batches=(1, 8, 32), repeats=5,
    ),
    # the test's: one batch size, two repeats
    "tiny": dict(
        hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256,
        prompt=(4, 12), new_tokens=8, batches=(1, 8), repeats=2,
    ),
}  # fmt: skip


def goal_for(batch: int) -> float:
    """The goal's ratio at ``batch`` (that of the largest goal batch not above it)."""
    return max(v for b, v in GOALS.items() if b <= batch)


def build_model(folder: Path, size: dict, seed: int = 0):
    """A random LlamaForCausalLM saved to ``folder``; returns the transformers model and
    nereus_rl's Decoder loaded from the folder (the same weights)."""
    transformers = import_transformers()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["ffn"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        max_position_embeddings=256,
        rope_theta=5e5,
        rms_norm_eps=1e-6,
        attn_implementation="sdpa",
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(folder)
    ours = Decoder(hf_config(folder))
    load_hf_weights(ours, folder)
    ours.eval()
    return hf, ours


def make_prompts(batch: int, lengths: tuple[int, int], vocab: int, seed: int):
    """``batch`` prompts of random lengths in ``lengths`` (token ids 1..vocab-1; 0 pads),
    left-padded: (ids [B, P], mask [B, P])."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    rows = []
    for _ in range(batch):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        rows.append(torch.randint(1, vocab, (n,), generator=g))
    return left_pad(rows, 0)


def run_ours(model, ids, mask, new_tokens: int, sample: bool, seed: int) -> torch.Tensor:
    """nereus_rl's generation, as the trainer's rollout calls it; the response ids."""
    gen = make_row_generators(seed, range(ids.shape[0])) if sample else None
    out = generate(
        model, ids, new_tokens, temperature=1.0 if sample else 0.0, generator=gen,
        pad_id=0, prompt_mask=None if bool(mask.all()) else mask,
    )  # fmt: skip
    return out.sequences[:, ids.shape[1] :]


def run_hf(model, ids, mask, new_tokens: int, sample: bool, seed: int) -> torch.Tensor:
    """transformers' generate on the same batch and lengths; the response ids."""
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else {}
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask.long(), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None,
            use_cache=True, **({"do_sample": False} if not sample else kw),
        )  # fmt: skip
    return out[:, ids.shape[1] :]


def _timed(fn) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_case(hf, ours, size: dict, batch: int, sample: bool, repeats: int, seed: int) -> dict:
    """One (batch, greedy/sampled) case: both generators, alternating; tokens/s each."""
    ids, mask = make_prompts(batch, size["prompt"], size["vocab"], seed + batch)
    n = size["new_tokens"]
    runs = {
        "nereus": lambda: run_ours(ours, ids, mask, n, sample, seed),
        "transformers": lambda: run_hf(hf, ids, mask, n, sample, seed),
    }
    outs = {k: f() for k, f in runs.items()}  # warm-up (and the outputs compared)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, f in runs.items():
            times[k].append(_timed(f)[0])
    for k in runs:
        assert outs[k].shape == (batch, n), (k, outs[k].shape)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = batch * n
    row = {
        "batch": batch,
        "mode": "sampled" if sample else "greedy",
        "prompt_width": ids.shape[1],
        "prompt_lengths": [int(x) for x in mask.sum(1)],
        "new_tokens": n,
        "nereus_s": best["nereus"],
        "transformers_s": best["transformers"],
        "nereus_tok_s": tokens / best["nereus"],
        "transformers_tok_s": tokens / best["transformers"],
        "nereus_median_tok_s": tokens / med["nereus"],
        "transformers_median_tok_s": tokens / med["transformers"],
        "runs_s": times,
    }
    row["ratio"] = row["nereus_tok_s"] / row["transformers_tok_s"]
    row["goal"] = goal_for(batch)
    row["meets_goal"] = row["ratio"] >= row["goal"]
    if not sample:
        row["greedy_equal"] = bool(torch.equal(outs["nereus"], outs["transformers"]))
    return row


def run(size_name: str, threads: int = 1, seed: int = 0, repeats: int | None = None) -> dict:
    """Every case of a size (``quick``, ``full`` or ``tiny``); the JSON record."""
    size = SIZES[size_name]
    transformers = import_transformers()
    load_before = os.getloadavg()[0]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hf, ours = build_model(Path(tmp), size, seed)
        rows = []
        for batch in size["batches"]:
            for sample in (False, True):
                rows.append(
                    bench_case(hf, ours, size, batch, sample, repeats or size["repeats"], seed)
                )
    finally:
        torch.set_num_threads(prev)
    return {
        "size": size_name,
        "model": {k: size[k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab")},
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "goals": {str(k): v for k, v in GOALS.items()},
        "rows": rows,
        "all_goals_met": all(r["meets_goal"] for r in rows),
        "seconds": time.perf_counter() - t0,
        # the machine's 1-minute load average before and after the cases
        "load_avg": [load_before, os.getloadavg()[0]],
    }


def table(rec: dict) -> str:
    """The record as a plain-text table."""
    m = rec["model"]
    lines = [
        f"rollout generation, {rec['size']}: Llama hidden {m['hidden']} x {m['layers']} "
        f"layers, vocab {m['vocab']}, {rec['threads']} thread(s), torch {rec['torch']}, "
        f"transformers {rec['transformers']}; load average {rec['load_avg'][0]:.1f} before, "
        f"{rec['load_avg'][1]:.1f} after",
        f"{'batch':>5} {'mode':<8} {'prompts':>9} {'new':>4} {'nereus tok/s':>13} "
        f"{'hf tok/s':>10} {'ratio':>6} {'goal':>5}  greedy equal",
    ]
    for r in rec["rows"]:
        lens = r["prompt_lengths"]
        span = f"{min(lens)}-{max(lens)}"
        eq = {True: "yes", False: "NO"}.get(r.get("greedy_equal"), "-")
        mark = "" if r["meets_goal"] else "  (below goal)"
        lines.append(
            f"{r['batch']:>5} {r['mode']:<8} {span:>9} {r['new_tokens']:>4} "
            f"{r['nereus_tok_s']:>13.0f} {r['transformers_tok_s']:>10.0f} "
            f"{r['ratio']:>5.2f}x {r['goal']:>4.1f}x  {eq}{mark}"
        )
    lines.append(f"all goals met: {rec['all_goals_met']} ({rec['seconds']:.0f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 0 (the goals are reported, not enforced)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small model (under 2 minutes)")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="overrides --quick")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both (1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the record")
    args = ap.parse_args(argv)
    size = args.size or ("quick" if args.quick else "full")
    rec = run(size, threads=args.threads, seed=args.seed, repeats=args.repeats)
    print(table(rec))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
