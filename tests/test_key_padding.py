"""Key rows padded to a bucket (so CPU GEMM kernels are reused across steps): masked, outputs unchanged."""

import pytest
import torch

import dspark.cache.pool as pool_module
import dspark.engine.runner as runner
from dspark.cache.pool import contiguous_start
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_pair
from dspark.sampling_params import SamplingParams


def test_padded_keys_rounds_up_to_the_bucket(monkeypatch):
    monkeypatch.setattr(runner, "KEY_BUCKET", 16)
    assert [runner.padded_keys(n) for n in (0, 1, 16, 17, 40)] == [0, 16, 16, 32, 48]


def _run(bucket: int, spec: SpeculativeConfig | None, window: int | None, monkeypatch) -> tuple[list, set[int]]:
    monkeypatch.setattr(runner, "KEY_BUCKET", bucket)
    torch.manual_seed(0)
    target, drafter = build_tiny_pair(3)
    if spec is not None and window is not None:
        spec = SpeculativeConfig(method=spec.method, num_speculative_tokens=3, draft_window=window)
    engine = Engine(target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=4))
    widths: set[int] = set()
    build, slots = engine.runner.build, engine.runner.context_slots

    def spy_build(*a, **kw):
        batch = build(*a, **kw)
        widths.add(batch.read_slots.shape[1])
        return batch

    def spy_slots(*a, **kw):
        read = slots(*a, **kw)
        widths.add(read.shape[1])
        return read

    engine.runner.build, engine.runner.context_slots = spy_build, spy_slots
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (3, 21, 9, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (12, 7, 20, 9)]
    outs = LLM.from_engine(engine).generate(prompts, params)
    return [o.token_ids for o in outs], widths


@pytest.mark.parametrize("method, window", [(None, None), ("dspark", None), ("dspark", 8), ("dflash", None)])
def test_padded_key_rows_change_no_token(method, window, monkeypatch):
    spec = None if method is None else SpeculativeConfig(method=method, num_speculative_tokens=3)
    exact, exact_widths = _run(1, spec, window, monkeypatch)
    padded, padded_widths = _run(16, spec, window, monkeypatch)
    assert padded == exact
    assert all(w % 16 == 0 for w in padded_widths)
    assert any(w % 16 for w in exact_widths)  # the unpadded run did see other widths


def test_contiguous_start_only_for_one_request_on_consecutive_slots_inside_the_pool():
    run = torch.tensor([[32, 33, 34, 35, 99, 99]])  # 4 valid keys, 2 padding rows pointing at the scratch slot
    assert contiguous_start(run, 4, 100) == 32
    assert contiguous_start(run, 4, 37) is None  # the padded width would run past the pool
    assert contiguous_start(torch.tensor([[32, 33, 48, 49]]), 4, 100) is None  # two pages apart
    assert contiguous_start(torch.tensor([[33, 32, 34]]), 3, 100) is None  # not in order
    assert contiguous_start(run.expand(2, 6), 4, 100) is None  # two requests gather
    assert contiguous_start(run, 0, 100) is None


def _generate_single(in_place: bool, method: str | None, monkeypatch) -> tuple[list, int]:
    hits = [0]

    def spy(*a):
        start = contiguous_start(*a) if in_place else None
        hits[0] += start is not None
        return start

    monkeypatch.setattr(pool_module, "contiguous_start", spy)
    torch.manual_seed(0)
    target, drafter = build_tiny_pair(3)
    spec = None if method is None else SpeculativeConfig(method=method, num_speculative_tokens=3)
    engine = Engine(target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=1))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (7, 40, 18)]
    llm = LLM.from_engine(engine)
    outs = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24))[0].token_ids for p in prompts]
    return outs, hits[0]


@pytest.mark.parametrize("method", [None, "dspark"])
def test_reading_one_requests_keys_in_place_changes_no_token(method, monkeypatch):
    gathered, _ = _generate_single(False, method, monkeypatch)
    in_place, hits = _generate_single(True, method, monkeypatch)
    assert in_place == gathered
    assert hits > 0  # requests one after another reuse freed pages in order: their slots stay consecutive


def test_no_empty_rows_opens_only_rows_that_see_no_key():
    """A padding row that sees no key is given every key (a finite softmax); a mask where every row sees a key is
    returned as it is (a long chunk's [B, T, S] mask is not copied)."""
    from dspark.models.layers import no_empty_rows

    mask = torch.tensor([[[True, False, False], [True, True, False], [False, False, False]]])
    opened = no_empty_rows(mask)
    assert opened[0, 2].all() and torch.equal(opened[0, :2], mask[0, :2])
    full = mask[:, :2]
    assert no_empty_rows(full) is full
