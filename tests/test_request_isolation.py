"""Bad requests are refused at the boundary (SamplingParams ranges, ``dspark generate --seed``), and anything that
still raises while the engine processes one request fails that request alone: its pages return, the others
finish exactly as they would have without it, and the engine keeps serving."""

from __future__ import annotations

import pytest

from dspark.cli import main
from dspark.llm import LLM, build_engine
from dspark.models.tiny import write_tiny_pair
from dspark.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

K = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))


def make_llm(pair, spec: bool = True) -> LLM:
    cfg = {"method": "dspark", "model": str(pair[1]), "num_speculative_tokens": K} if spec else None
    return LLM.from_engine(build_engine(pair[0], cfg, dtype="float32", max_num_seqs=4))


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**64),
        ("seed", 2**63),
        ("seed", -(2**64)),
        ("seed", INT64_MIN - 1),
        ("seed", True),
        ("top_k", 2**63),
        ("top_k", -2),
        ("top_k", 1.5),
        ("max_tokens", 2**63),
        ("max_tokens", True),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 101),
        ("top_p", float("nan")),
        ("top_p", 0.0),
        ("n", 0),
        ("stop", ["ok", 5]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [2**63]),
        ("ignore_eos", "yes"),
    ],
)
def test_sampling_params_refuse_out_of_range_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"sampling parameter {field}="):
        SamplingParams(**{field: value})


def test_sampling_params_accept_the_int64_edges():
    assert SamplingParams(seed=INT64_MAX).seed == INT64_MAX
    assert SamplingParams(seed=INT64_MIN, top_k=INT64_MAX).top_k == INT64_MAX
    assert SamplingParams(stop="x", top_k=-1).stop == ("x",) and SamplingParams(top_k=-1).top_k == 0


def test_int64_edge_seeds_sample(pair):
    llm = make_llm(pair, spec=False)
    outs = llm.generate(["a", "b"], [SamplingParams(seed=s, max_tokens=4) for s in (INT64_MIN, INT64_MAX)])
    assert all(o.finish_reason == "length" and o.error is None for o in outs)


def test_generate_cli_refuses_an_overflowing_seed_before_loading(capsys, monkeypatch):
    def no_load(*a, **kw):
        raise AssertionError("the engine must not be built for a bad --seed")

    monkeypatch.setattr("dspark.llm.build_engines", no_load)
    assert main(["generate", "hi", "--seed", str(2**64)]) == 1
    err = capsys.readouterr().err
    assert "seed=18446744073709551616" in err and "int64" in err and "Traceback" not in err


def _poison(engine, bad_prompt: list[int], method: str = "target_forward") -> None:
    """Make a runner method raise whenever the request with prompt ``bad_prompt`` is in its batch."""
    real = getattr(engine.runner, method)

    def faulty(reqs, *a, **kw):
        if any(r.prompt_ids == bad_prompt for r in reqs):
            raise RuntimeError("injected fault")
        return real(reqs, *a, **kw)

    setattr(engine.runner, method, faulty)


@pytest.mark.parametrize("method", ["target_forward", "propose_draft"])
def test_a_request_that_raises_fails_alone_and_the_engine_keeps_serving(pair, method):
    good, bad = [1, 5, 9, 13], [2, 4, 6, 8]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    expected = make_llm(pair).generate([good], params)[0]
    llm = make_llm(pair)
    _poison(llm.engine, bad, method)
    outs = llm.generate([good, bad, good], params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error == "RuntimeError: injected fault"
    assert outs[0].token_ids == outs[2].token_ids == expected.token_ids  # the reruns changed nothing
    engine = llm.engine
    assert engine.num_pages_free == engine.pool.num_pages and not engine.has_unfinished
    assert engine.metrics.num_requests_failed == 1
    assert llm.generate([good], params)[0].token_ids == expected.token_ids


def test_a_seed_that_slips_past_validation_fails_only_its_request(pair):
    llm = make_llm(pair)
    ok = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
    smuggled = SamplingParams(temperature=0.8, seed=1, max_tokens=6)
    object.__setattr__(smuggled, "seed", 2**64)  # as if validation had a hole: overflows in the int64 tensor
    outs = llm.generate(["x", "y", "z"], [ok, smuggled, ok])
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "Overflow" in outs[1].error
    assert llm.engine.num_pages_free == llm.engine.pool.num_pages
