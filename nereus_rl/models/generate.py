"""Autoregressive generation with a KV cache, under tensor and pipeline parallelism.

Sampling never gathers the full logits: with ``temperature > 0`` each tp rank adds
Gumbel noise to its vocab shard of ``logits / temperature`` and the token is the
vocab-parallel argmax (the Gumbel-max trick draws exactly from
softmax(logits / temperature)); ``temperature == 0`` is greedy. The noise for the
whole vocabulary is drawn from the caller's generator on every tp rank and each
keeps its slice, so a sharded run picks the same tokens as a single process
with the same seed. With one generator per row (:func:`make_row_generators`,
keyed by the sample's index in the whole batch), a sample's noise does not depend
on which rows share its batch either, so any split of a batch over data-parallel
replicas draws the same samples (the trainer relies on this: its rollout layout
changes with the plan). The last pipeline stage picks the token and broadcasts it
to the other stages. Generation does not pipeline micro-batches: the whole batch
walks the stages one step at a time (fine for the rollout sizes used here).

Prompts of different lengths are left-padded to one width P with a ``prompt_mask``
(1 = real token; :func:`left_pad` builds both): every response then starts at column P,
so response masks, :func:`nereus_rl.models.parallel.response_logprobs` and
``response_values`` stay as they are. Each row's positions count from its first real
token and no query attends to a padding key, in the prompt's forward and in every
cached decoding step (the attention mask grows by one real column per step, as in
Hugging Face's generation), so a row generates what it would generate alone. Without a
``prompt_mask`` (or with one that has no zero) prompts share one length and no mask is
built. Finished sequences are padded after their EOS token.

The cached steps run :func:`nereus_rl.models.decode.decode_forward`, generation's own
forward: the same numbers as ``Decoder.forward`` with a cache, with less work per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nereus_rl.models.decode import (
    DecodeWeights,
    Packing,
    additive_mask,
    decode_forward,
    pack_min_tokens,
)
from nereus_rl.models.model import (
    RotaryTables,
    attention_bias,
    full_attention_mask,
    position_ids,
    rotary_tables,
)
from nereus_rl.models.parallel import ParallelGroups, vocab_parallel_argmax
from nereus_rl.models.pipeline import broadcast_from_last, recv, send


class KVCache:
    """Keys and values of this rank's layers (its stage, its kv-head shard).

    Arguments:
        model: this rank's Decoder stage.
        batch: batch size.
        max_len: longest prompt + response the cache will hold.
    """

    def __init__(self, model, batch: int, max_len: int) -> None:
        c = model.config
        heads = c.num_kv_heads // model.groups.tp_size
        dev = next(model.parameters()).device
        shape = (batch, heads, max_len, c.head_dim)
        self.keys = {i: torch.empty(shape, dtype=model.dtype, device=dev) for i in model.layer_ids}
        self.values = {
            i: torch.empty(shape, dtype=model.dtype, device=dev) for i in model.layer_ids
        }
        self.length = 0
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, heads, T, d] after the cached ones; return all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} were asked for")
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, t: int) -> None:
        """Mark ``t`` more positions as cached (after every layer of the stage stored them)."""
        self.length += t


@dataclass
class GenerationOutput:
    """``sequences`` [B, P + N]: prompts then responses; ``response_mask`` [B, N] (float):
    1 for generated tokens up to and including EOS, 0 for the padding after it;
    ``prompt_mask`` [B, P]: the left-padded prompts' mask as given to :func:`generate`
    (None for prompts of one length)."""

    sequences: torch.Tensor
    response_mask: torch.Tensor
    prompt_len: int
    prompt_mask: torch.Tensor | None = None

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len :]

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """[B, P + N] for scoring ``sequences`` (pipeline_forward's ``attention_masks``),
        None for prompts of one length."""
        if self.prompt_mask is None:
            return None
        return full_attention_mask(self.prompt_mask, self.sequences.shape[1])


def left_pad(
    prompts: Sequence[torch.Tensor], pad_id: int = 0, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D prompts of any lengths into ids [B, P] and their ``prompt_mask`` [B, P].

    Arguments:
        prompts: token ids, one 1-D tensor per row (at least one token each).
        pad_id: id written in the padding (never attended to; any id in the vocabulary).
        width: P (default: the longest prompt).

    Raises:
        ValueError: no prompts, an empty prompt, or one longer than ``width``.
    """
    lens = [int(p.shape[0]) for p in prompts]
    if not lens:
        raise ValueError("left_pad needs at least one prompt")
    width = max(lens) if width is None else width
    if min(lens) < 1 or max(lens) > width:
        raise ValueError(f"prompt lengths {lens} must be 1 .. width={width}")
    device = prompts[0].device
    ids = torch.full((len(lens), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(lens), width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - lens[i] :] = p
        mask[i, width - lens[i] :] = 1
    return ids, mask


def _check_prompt_mask(prompt_mask: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
    """``prompt_mask`` as long 0/1, after checking that it left-pads ``prompts``."""
    if tuple(prompt_mask.shape) != tuple(prompts.shape):
        raise ValueError(
            f"prompt_mask is {tuple(prompt_mask.shape)}, prompts are {tuple(prompts.shape)}; "
            "give one 0/1 per prompt token"
        )
    keep = prompt_mask.bool()
    # Left padding only: a response must start right after each row's last real token.
    if not bool(keep[:, -1].all()) or bool((keep[:, 1:] < keep[:, :-1]).any()):
        raise ValueError(
            "prompt_mask must left-pad the prompts (zeros, then at least one 1 in every row); "
            "build it with left_pad()"
        )
    return keep.long()


def make_generator(
    seed: int, groups: ParallelGroups | None = None, device="cpu"
) -> torch.Generator:
    """A sampling generator for this rank: same stream on every tp/pp rank of a replica,
    a different one per data-parallel replica (so replicas do not sample alike).

    One stream serves the whole local batch, so what a row samples depends on the
    replica and on its place in the replica's batch: use :func:`make_row_generators`
    where the same samples must come out of any data-parallel split.
    """
    groups = groups or ParallelGroups.single()
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + groups.dp_rank)


def make_row_generators(seed: int, rows: Sequence[int], device="cpu") -> list[torch.Generator]:
    """One sampling generator per row, seeded by (``seed``, the row's global index).

    Arguments:
        seed: the call's sampling seed (the same on every rank).
        rows: global sample indices of this rank's batch rows, in order (for rows
            ``first .. first + n - 1`` of the whole batch: ``range(first, first + n)``).
        device: where the noise is drawn.

    Every tp/pp rank of a replica must pass the same rows. Row ``i`` gets the same
    stream whichever replica holds it and whatever its batch-mates are, which makes
    sampling invariant to how the batch is split over data-parallel replicas.
    """
    return [torch.Generator(device=device).manual_seed(seed * 1_000_003 + r) for r in rows]


def _stage_forward(model, x: torch.Tensor, batch: int, groups: ParallelGroups, forward):
    """``forward`` (a function of this stage's input) on this stage's input: the ids on
    the first stage, the previous stage's hidden states elsewhere; the last stage's
    output (None on the others, which send theirs on)."""
    if not model.is_first:
        x = recv(
            (batch, x.shape[1], model.config.hidden),
            model.dtype,
            x.device,
            groups.pp_rank - 1,
            groups,
        )
    y = forward(x)
    if not model.is_last:
        send(y, groups.pp_rank + 1, groups)
        return None
    return y


class _Steps:
    """The cached forward of each generation step, with what every step shares: the KV
    cache, the fused weights (:class:`DecodeWeights`) and, for left-padded prompts, the
    additive mask of the whole sequence, which each step slices (a decoding step's
    query is the last position: it may attend to every real key before it).

    Positions and masks are those :meth:`Decoder.forward` derives from the 0/1 mask of
    the positions so far: each row's positions count from its first real token.
    """

    def __init__(self, model, batch: int, prompt_len: int, total: int, full_mask, device):
        self.model = model
        self.cache = KVCache(model, batch, total)
        self.weights = DecodeWeights.of(model, rows=batch)
        self.inv_freq = model.inv_freq(device)
        self.prompt_len = prompt_len
        self.keep = self.mask = self.last_pos = None
        if full_mask is not None and not bool(full_mask.all()):
            self.keep = full_mask[:, :prompt_len].bool()
            # the decoding steps' mask: every real key so far, sliced per step
            self.mask = additive_mask(full_mask.bool()[:, None, None, :], model.dtype)
            # each row's position of its last prompt token
            self.last_pos = self.keep.long().sum(1, keepdim=True) - 1
            self.num_tokens = int(self.keep.sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's output for the next positions ``x`` (the prompt, then one token)."""
        past = self.cache.length
        t = x.shape[1]
        device = x.device
        packing = None
        if self.keep is None:
            positions = torch.arange(past, past + t, device=device)
            mask = None
        elif past == 0:
            positions = position_ids(self.keep)
            mask = additive_mask(attention_bias(self.keep, t), self.model.dtype)
            if self.weights.fused and self.num_tokens >= pack_min_tokens(self.model):
                packing = Packing.of(self.keep)
        else:
            positions = self.last_pos + (past + 1 - self.prompt_len)
            mask = self.mask[..., : past + t]
        rope = rotary_tables(positions, self.inv_freq)
        if packing is not None:  # the real tokens' tables, computed as the padded ones
            rope = RotaryTables(packing.pack(rope.cos), packing.pack(rope.sin))
        return decode_forward(self.model, x, rope, self.cache, self.weights, mask, packing)


#: Most uniform numbers, all rows together (16 MiB of fp32), drawn ahead of the steps.
NOISE_AHEAD = 1 << 22


class _Noise:
    """The uniform noise [B, vocab] of each sampling step, from one generator for the whole
    batch or one per row (see :func:`make_row_generators`).

    A CPU generator draws uniform numbers one after another, so ``n`` draws of ``vocab``
    numbers are the same numbers, and leave it in the same state, as one draw of
    ``n * vocab``: per-row CPU generators draw the steps ahead (up to :data:`NOISE_AHEAD`
    numbers in all) in one call per row instead of one call per row and step. :meth:`close`
    puts each generator where the steps taken would have left it. Other generators (one
    for the batch, or a device's, whose streams are counter-based) draw step by step.
    """

    def __init__(self, generator, batch: int, vocab: int, steps: int, device) -> None:
        self.generator, self.batch, self.vocab, self.device = generator, batch, vocab, device
        self.left = steps
        self.ahead = None
        if not isinstance(generator, torch.Generator) and all(
            g.device.type == "cpu" for g in generator
        ):
            self.ahead = max(1, NOISE_AHEAD // max(1, batch * vocab))
        self.buf: torch.Tensor | None = None
        self.used = 0
        self.states: list[torch.Tensor] = []

    def next(self) -> torch.Tensor:
        """The next step's noise, [B, vocab], contiguous, the caller's to overwrite."""
        shape = (self.batch, self.vocab)
        if isinstance(self.generator, torch.Generator):
            return torch.rand(shape, generator=self.generator, device=self.device)
        if self.ahead is None:
            u = torch.empty(shape, device=self.device)
            for row, g in zip(u, self.generator):
                torch.rand(self.vocab, generator=g, device=self.device, out=row)
            return u
        if self.buf is None or self.used == self.buf.shape[1]:
            n = max(1, min(self.ahead, self.left))
            self.left -= n
            self.states = [g.get_state() for g in self.generator]
            self.buf = torch.empty((self.batch, n, self.vocab), device=self.device)
            for rows, g in zip(self.buf, self.generator):
                torch.rand((n, self.vocab), generator=g, device=self.device, out=rows)
            self.used = 0
        self.used += 1
        # a copy: the noise is transformed in place, in the layout of a [B, vocab] draw
        return self.buf[:, self.used - 1].clone(memory_format=torch.contiguous_format)

    def close(self) -> None:
        """Rewind per-row generators that drew ahead past the last step taken."""
        if self.buf is not None and self.used < self.buf.shape[1]:
            for g, state in zip(self.generator, self.states):
                g.set_state(state)
                torch.rand(self.used * self.vocab, generator=g, device=self.device)


def _pick(logits: torch.Tensor, temperature: float, noise, groups: ParallelGroups):
    scores = logits.float()
    if temperature > 0:
        u = noise.next()
        # -log(-log(u)) in place, over the whole draw: an elementwise kernel may round a
        # row's tail on another path, so a slice of it could differ from the same slice
        # of the whole, and every tp layout must see the same noise.
        gumbel = u.clamp_(min=1e-20).log_().neg_().log_().neg_()
        width = scores.shape[-1]
        scores = (
            scores / temperature + gumbel[:, groups.tp_rank * width : (groups.tp_rank + 1) * width]
        )
    return vocab_parallel_argmax(scores, groups)


@torch.no_grad()
def generate(
    model,
    prompts: torch.Tensor,
    max_new_tokens: int,
    *,
    groups: ParallelGroups | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
    use_cache: bool = True,
    prompt_mask: torch.Tensor | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``prompts``; collective over tp and pp.

    Arguments:
        model: this rank's Decoder stage (policy).
        prompts: token ids [B, P], the same on every rank of the replica.
        max_new_tokens: response length limit.
        groups: this rank's groups (default: single process).
        temperature: 0 for greedy, > 0 to sample from softmax(logits / temperature).
        generator: sampling generator (see :func:`make_generator`), or one per row of
            ``prompts`` (see :func:`make_row_generators`); required if sampling.
        eos_id: stop a sequence after this token (all stop -> generation stops early).
        pad_id: written after a sequence's EOS.
        use_cache: keep a KV cache (otherwise recompute the whole prefix every step).
        prompt_mask: [B, P] (0/1 or bool), 1 = a real prompt token, for prompts of
            different lengths left-padded to P (see :func:`left_pad`); the same on every
            rank of the replica. None: every prompt has all P tokens.

    Returns:
        The same :class:`GenerationOutput` on every rank of the replica.

    Raises:
        ValueError: the sequence would exceed ``max_seq_len``, a critic model, sampling
            without a generator, per-row generators that do not match the rows, or a
            ``prompt_mask`` that does not left-pad ``prompts``.
    """
    groups = groups or model.groups
    if model.is_critic:
        raise ValueError("generate() needs the policy model; got the value-head (critic) variant")
    batch, prompt_len = prompts.shape
    if prompt_len + max_new_tokens > model.config.max_seq_len:
        raise ValueError(
            f"prompt {prompt_len} + {max_new_tokens} new tokens exceeds max_seq_len="
            f"{model.config.max_seq_len} of {model.config.name!r}; shorten the response limit"
        )
    if temperature > 0 and generator is None:
        raise ValueError("sampling (temperature > 0) needs a generator; see make_generator()")
    if generator is not None and not isinstance(generator, torch.Generator):
        generator = list(generator)
        if len(generator) != batch:
            raise ValueError(
                f"{len(generator)} per-row generators for {batch} prompt rows; pass one per "
                "row (make_row_generators(seed, rows) with this batch's global row indices)"
            )
    if prompt_mask is not None:
        prompt_mask = _check_prompt_mask(prompt_mask, prompts)
    total = prompt_len + max_new_tokens
    device = prompts.device
    # The whole sequence is allocated once; step s uses its first prompt_len + s columns.
    buf = torch.empty(batch, total, dtype=prompts.dtype, device=device)
    buf[:, :prompt_len] = prompts
    full_mask = None
    if prompt_mask is not None:
        # the prompt's mask, then one real column per generated token
        full_mask = full_attention_mask(prompt_mask, total)
    steps = _Steps(model, batch, prompt_len, total, full_mask, device) if use_cache else None
    noise = None
    if model.is_last and temperature > 0:
        noise = _Noise(generator, batch, model.config.vocab, max_new_tokens, device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    masks = []
    end = prompt_len
    for step in range(max_new_tokens):
        if steps is not None:
            x = buf[:, :end] if step == 0 else buf[:, end - 1 : end]
            logits = _stage_forward(model, x, batch, groups, steps.forward)
        else:
            attn = None if full_mask is None else full_mask[:, :end]

            def forward(x, attn=attn):
                return model(x, attention_mask=attn, last_only=True)

            logits = _stage_forward(model, buf[:, :end], batch, groups, forward)
        tok = None
        if model.is_last:
            tok = _pick(logits[:, -1], temperature, noise, groups)
            if eos_id is not None:
                tok = tok.masked_fill(finished, pad_id)
        tok = broadcast_from_last(tok, (batch,), torch.long, groups, device)
        buf[:, end] = tok
        end += 1
        if eos_id is not None:
            masks.append((~finished).float())
            finished = finished | (tok == eos_id)
            if bool(finished.all()):
                break
    if noise is not None:
        noise.close()
    if eos_id is None:  # no row ever finishes
        mask = torch.ones(batch, end - prompt_len, device=device)
    else:
        mask = torch.stack(masks, 1) if masks else torch.zeros(batch, 0, device=device)
    return GenerationOutput(buf[:, :end].contiguous(), mask, prompt_len, prompt_mask)
