"""Schemathesis checks of the dspark server's own contract, loaded into the fuzzer by ``test_server_conformance``
(``SCHEMATHESIS_HOOKS=conformance_checks``). They narrow or add to Schemathesis' checks; none loosens one.

- ``deployment_limits_only``: a request the schema calls valid may still get a 400, but only for a limit of the
  served model or of the server's flags (an error code in ``DEPLOYMENT_LIMIT_CODES``), which no JSON Schema can
  state. The test lets Schemathesis' ``positive_data_acceptance`` allow 400 and this check vets each one. A body
  holding a number beyond 2**53 is not judged: Schemathesis compares such numbers in floating point, so near the
  int64 bounds of ``seed`` / ``top_k`` / ``stop_token_ids`` it calls 2**63 + 190 valid against a maximum of
  2**63 - 1 (JSON numbers are exact only within +-2**53, RFC 7493).
- ``sse_events_match_models``: every event of a streamed answer is a chunk of the route's stream model (or an
  error object), and the stream ends with ``data: [DONE]``, as /openapi.json describes it in words (Schemathesis
  reads at most 20 events, then hangs up: a stream it cut short is checked up to there).
- ``EveryOperationSucceeds``: each operation answered 2xx at least once, so the run exercised more than errors.
"""

from __future__ import annotations

import json

import schemathesis
from pydantic import BaseModel, ValidationError
from schemathesis.specs.openapi.checks import is_unexpected_http_status_case

from dspark.serve.protocol import (
    DEPLOYMENT_LIMIT_CODES,
    ChatCompletionStreamResponse,
    CompletionStreamResponse,
    ErrorResponse,
)

STREAM_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionStreamResponse,
    "/v1/chat/completions": ChatCompletionStreamResponse,
}


EXACT_JSON_INT = 2**53


def _beyond_exact_numbers(value: object) -> bool:
    if isinstance(value, dict):
        return any(_beyond_exact_numbers(v) for v in value.values())
    if isinstance(value, list):
        return any(_beyond_exact_numbers(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) > EXACT_JSON_INT


def _error_code(response) -> object:
    try:
        return json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@schemathesis.check
def deployment_limits_only(ctx, response, case) -> None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or is_unexpected_http_status_case(case):
        return
    if _beyond_exact_numbers(case.body):
        return
    if response.status_code == 400 and _error_code(response) not in DEPLOYMENT_LIMIT_CODES:
        raise AssertionError(
            "a request valid by the schema got a 400 that is not a deployment limit (error code "
            f"{_error_code(response)!r}, not one of {sorted(DEPLOYMENT_LIMIT_CODES)}): declare the rule in the "
            f"request model (dspark.serve.protocol) or accept the request. Body: {response.content[:500]!r}"
        )


def _sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


@schemathesis.check
def sse_events_match_models(ctx, response, case) -> None:
    content_type = (response.headers.get("content-type") or [""])[0]
    if response.status_code != 200 or not content_type.startswith("text/event-stream"):
        return
    model = STREAM_MODELS.get(case.operation.path)
    if model is None:
        raise AssertionError(f"{case.operation.path} streamed, but only {sorted(STREAM_MODELS)} stream")
    events = _sse_data(response.content.decode("utf-8"))
    if not response.stream_cut_short and (not events or events[-1] != "[DONE]"):  # Schemathesis reads <= 20 events
        raise AssertionError(f"the stream does not end with 'data: [DONE]': {events[-3:]!r}")
    for data in (e for e in events if e != "[DONE]"):
        try:
            model.model_validate_json(data)
        except ValidationError:
            try:
                ErrorResponse.model_validate_json(data)
            except ValidationError as e:
                raise AssertionError(f"an event is neither a {model.__name__} nor an error object: {data!r}") from e


@schemathesis.check
class EveryOperationSucceeds:
    """Fail when an operation never answered 2xx: its schema would then describe nothing the server accepts."""

    def __init__(self) -> None:
        self.tested: set[str] = set()
        self.reached: set[str] = set()

    def after_response(self, ctx, response, case) -> None:
        self.tested.add(case.operation.label)
        if 200 <= response.status_code < 300:
            self.reached.add(case.operation.label)

    def after_run(self, ctx) -> None:
        never = self.tested - self.reached
        if never:
            raise AssertionError("never answered 2xx: " + ", ".join(sorted(never)))
