"""lm-evaluation-harness as a real client (the ``dev`` extra): ``local-completions`` runs a multiple-choice
(log-likelihood: ``echo`` + ``logprobs``) task and a ``generate_until`` task, and ``local-chat-completions`` a
generation task, all written here as local JSONL, against ``dspark serve`` on the bundled k3-mini pair with and
without speculation. The log-likelihoods agree to fp32 rounding (a verification forward's GEMM shapes differ from a
one-row decode's; the prompt's come from one prefill either way) and the greedy generations are identical."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the harness comes with the dev extra: pip install -e '.[dev]'")

from dspark.llm import MLA_DRAFT, MLA_TARGET, build_engine  # noqa: E402
from serve_helpers import serving  # noqa: E402

pytestmark = pytest.mark.skipif(not (MLA_TARGET / "config.json").exists(), reason="needs the bundled k3-mini pair")

TOL = 1e-5  # fp32, as tests/test_serve_sampling.py
QUESTIONS = [
    ("def add(a, b):\n    return a", [" + b", " - b", " * b"]),
    ("for i in range(10):\n   ", [" print(i)", " pass", " break"]),
    ("import numpy as", [" np", " pd", " torch"]),
]
PROMPTS = ["def fib(n):\n", "class Stack:\n    def __init__(self):\n", "# read a file\nwith open("]


def _write_tasks(root):
    (root / "mc.jsonl").write_text("".join(json.dumps({"q": q, "choices": c, "gold": 0}) + "\n" for q, c in QUESTIONS))
    (root / "gen.jsonl").write_text("".join(json.dumps({"q": p, "answer": ""}) + "\n" for p in PROMPTS))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "dspark_mc.yaml").write_text(
        f"task: dspark_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: gold\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    gen = (
        f"{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\noutput_type: generate_until\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: answer\ntarget_delimiter: ''\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 24\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    (root / "dspark_gen.yaml").write_text("task: dspark_gen\n" + gen)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    _write_tasks(root)
    return root


@pytest.fixture(scope="module")
def servers():
    spec = {"method": "dspark", "model": str(MLA_DRAFT), "num_speculative_tokens": 4, "speculation_guard": False}
    plain = build_engine(MLA_TARGET, None, dtype="float32", max_model_len=256)
    spec_engine = build_engine(MLA_TARGET, spec, dtype="float32", max_model_len=256)
    with serving(plain) as plain_url, serving(spec_engine) as spec_url:
        yield {"plain": (plain_url, plain), "spec": (spec_url, spec_engine)}


def _evaluate(url, tasks_dir, model, task_names, chat=False):
    from lm_eval.tasks import TaskManager

    path = "chat/completions" if chat else "completions"
    args = {
        "model": "k3-mini",
        "base_url": f"{url}/v1/{path}",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(MLA_TARGET),
        "num_concurrent": 1,
        "max_retries": 1,
    }
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=task_names,
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        apply_chat_template=chat,
        bootstrap_iters=0,
    )
    return {name: [s["filtered_resps"] for s in samples] for name, samples in out["samples"].items()}


def _lls(resps):
    return [[float(r[0]) if isinstance(r, list | tuple) else float(r) for r in doc] for doc in resps]


@pytest.fixture(scope="module")
def completions(servers, tasks, monkeypatch_module):
    return {k: _evaluate(u, tasks, "local-completions", ["dspark_mc", "dspark_gen"]) for k, (u, _) in servers.items()}


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("hf_datasets")
    for key, value in {"HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():
        mp.setenv(key, value)
    yield mp
    mp.undo()


def test_loglikelihoods_are_equal_with_and_without_speculation(completions, servers):
    plain, spec = _lls(completions["plain"]["dspark_mc"]), _lls(completions["spec"]["dspark_mc"])
    assert len(plain) == len(QUESTIONS) and all(len(doc) == 3 for doc in plain)
    assert all(ll < 0 for doc in plain for ll in doc)  # real log-likelihoods of multi-token continuations
    for a, b in zip(plain, spec):
        assert all(abs(x - y) <= TOL for x, y in zip(a, b)), (a, b)


def test_greedy_generations_are_identical_with_and_without_speculation(completions, servers):
    plain, spec = completions["plain"]["dspark_gen"], completions["spec"]["dspark_gen"]
    assert len(plain) == len(PROMPTS) and any(doc[0].strip() for doc in plain)
    assert plain == spec
    assert servers["spec"][1].metrics.spec.num_draft_tokens > 0  # the speculative server did speculate


def test_chat_generations_are_identical_with_and_without_speculation(servers, tasks, monkeypatch_module):
    got = {k: _evaluate(u, tasks, "local-chat-completions", ["dspark_gen"], chat=True) for k, (u, _) in servers.items()}
    assert got["plain"]["dspark_gen"] == got["spec"]["dspark_gen"]
    assert any(doc[0].strip() for doc in got["plain"]["dspark_gen"])
