"""Sampling does not depend on how a batch is split over data-parallel replicas
(single process: each split is generated part by part, as its replicas would).

The trainer's rollout layout changes with the plan (an adaptive run's start plan
answers calibration timings), and an adaptive run is checked against a static one
by equal rewards; with one stream per dp replica the same seed sampled other
tokens under dp 2 than under dp 1 (step-0 GRPO reward 0.0688 against 0.0229).
"""

from __future__ import annotations

import pytest
import torch

from nereus_rl.models.generate import generate, make_generator, make_row_generators
from nereus_rl.models.model import Decoder, get_preset
from nereus_rl.models.parallel import ParallelGroups

TINY = get_preset("tiny")
KW = {"temperature": 1.0, "eos_id": 1, "max_new_tokens": 12}


def _split_sizes(n: int, parts: int) -> list[int]:
    # the trainer's split: sizes differ by at most one, rows stay in order
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _by_parts(model, prompts: torch.Tensor, seed: int, parts: int, per_replica: bool):
    seqs, masks, first = [], [], 0
    for dp_rank, size in enumerate(_split_sizes(prompts.shape[0], parts)):
        mine = prompts[first : first + size]
        if per_replica:
            gen = make_generator(seed, ParallelGroups(dp_rank=dp_rank, dp_size=parts))
        else:
            gen = make_row_generators(seed, range(first, first + size))
        out = generate(model, mine, generator=gen, **KW)
        pad = KW["max_new_tokens"] - out.response_mask.shape[1]
        seqs.append(torch.nn.functional.pad(out.sequences, (0, pad)))
        masks.append(torch.nn.functional.pad(out.response_mask, (0, pad)))
        first += size
    return torch.cat(seqs), torch.cat(masks)


@pytest.fixture(scope="module")
def model_and_prompts():
    torch.manual_seed(0)
    return Decoder(TINY, seed=3), torch.randint(2, TINY.vocab, (8, 6))


@pytest.mark.parametrize("parts", [2, 3, 4, 8])
def test_row_generators_sample_the_same_under_any_dp_split(model_and_prompts, parts):
    model, prompts = model_and_prompts
    whole_seq, whole_mask = _by_parts(model, prompts, 11, 1, per_replica=False)
    seq, mask = _by_parts(model, prompts, 11, parts, per_replica=False)
    assert torch.equal(seq, whole_seq)
    assert torch.equal(mask, whole_mask)


def test_per_replica_streams_depend_on_the_split(model_and_prompts):
    # the old keying (what the trainer used): the check above can fail
    model, prompts = model_and_prompts
    whole, _ = _by_parts(model, prompts, 11, 1, per_replica=True)
    split, _ = _by_parts(model, prompts, 11, 2, per_replica=True)
    assert not torch.equal(split, whole)


def test_row_generators_follow_the_seed_and_the_row(model_and_prompts):
    model, prompts = model_and_prompts
    a, _ = _by_parts(model, prompts, 11, 1, per_replica=False)
    b, _ = _by_parts(model, prompts, 12, 1, per_replica=False)
    assert not torch.equal(a, b)
    # the same prompt in two rows draws two different samples
    same = prompts[:1].repeat(8, 1)
    out = generate(model, same, generator=make_row_generators(11, range(8)), **KW)
    assert len({tuple(r.tolist()) for r in out.responses}) > 1


def test_per_row_generators_must_match_the_rows(model_and_prompts):
    model, prompts = model_and_prompts
    with pytest.raises(ValueError, match="per-row generators for 8 prompt rows"):
        generate(model, prompts, generator=make_row_generators(11, range(3)), **KW)
