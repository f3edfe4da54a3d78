"""Context-length groups: a long request among short ones gets a forward of its own, outputs unchanged."""

import itertools

import pytest
import torch

from dspark.config import ConfigError, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.grouping import length_groups
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_pair
from dspark.sampling_params import SamplingParams


def _cost(groups, keys, rows, fixed):
    return sum(fixed + len(g) * max(rows[i] for i in g) * (max(keys[i] for i in g) + fixed) for g in groups)


def test_one_long_request_among_short_ones_is_split_off():
    keys, rows = [200] * 31 + [16000], [8] * 32
    groups = length_groups(keys, rows, 8192)
    assert groups == [list(range(31)), [31]]
    assert _cost(groups, keys, rows, 8192) < _cost([list(range(32))], keys, rows, 8192)


@pytest.mark.parametrize(
    "keys, rows",
    [([300, 310, 290, 305], [1] * 4), ([1000, 2000, 1500, 1800], [8] * 4), ([5], [5])],
)
def test_batches_without_much_padding_stay_whole(keys, rows):
    assert length_groups(keys, rows, 8192) == [list(range(len(keys)))]


def test_zero_disables_splitting_and_bad_input_is_refused():
    assert length_groups([10, 100_000], [1, 1], 0) == [[0, 1]]
    with pytest.raises(ValueError, match="row counts"):
        length_groups([1, 2], [1], 8)
    with pytest.raises(ConfigError, match="split_batch_keys"):
        EngineConfig(split_batch_keys=-1)


def test_groups_are_an_optimal_partition_into_contiguous_length_ranges():
    """Brute force over every contiguous partition of the sorted requests: the DP finds the least cost."""
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(2, 7, (1,), generator=g))
        keys = torch.randint(1, 3000, (n,), generator=g).tolist()
        rows = torch.randint(1, 40, (n,), generator=g).tolist()
        fixed = int(torch.randint(1, 500, (1,), generator=g))
        groups = length_groups(keys, rows, fixed)
        assert sorted(i for grp in groups for i in grp) == list(range(n))
        order = sorted(range(n), key=lambda i: (keys[i], rows[i]))
        best = min(
            _cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, n))], keys, rows, fixed)
            for m in range(n)
            for cuts in itertools.combinations(range(1, n), m)
        )
        assert _cost(groups, keys, rows, fixed) == best


def _run(split: int, spec: SpeculativeConfig | None, prompts, params):
    torch.manual_seed(0)
    target, drafter = build_tiny_pair(3)
    engine = Engine(target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=8, split_batch_keys=split))
    seen: list[int] = []
    forward = engine.runner.target_forward

    def spy(reqs, starts, tokens, **kw):
        seen.append(max(s + len(t) for s, t in zip(starts, tokens)))  # keys of this forward
        return forward(reqs, starts, tokens, **kw)

    engine.runner.target_forward = spy
    outs = LLM.from_engine(engine).generate(prompts, params)
    return [o.token_ids for o in outs], seen, engine


@pytest.mark.parametrize("method", [None, "dspark"])
def test_split_batches_give_the_same_tokens_and_short_forwards(method):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (3, 5, 4, 90, 6)]
    params = [SamplingParams(temperature=0.0, max_tokens=6), *[SamplingParams(temperature=0.0, max_tokens=8)] * 4]
    spec = None if method is None else SpeculativeConfig(method=method, num_speculative_tokens=3)
    whole, seen_whole, _ = _run(0, spec, prompts, params)
    split, seen_split, engine = _run(16, spec, prompts, params)
    assert split == whole
    short = [k for k in seen_split if k < 40]
    assert short and max(seen_whole) >= 90 and len(seen_split) > len(seen_whole)
    assert engine.metrics.num_requests_finished == len(prompts)
