"""/openapi.json with the served model's limits: the request models mark what depends on the model
(``protocol.*_MARK``) and this fills it in once, when the schema is first built.

- token ids (completions' prompt as ids, /detokenize's tokens): ``maximum`` vocab - 1;
- a prompt as token ids: ``maxItems`` max_model_len - 1 (at least one token must fit after it);
- ``max_tokens`` / ``max_completion_tokens``: ``maximum`` max_model_len - 1 (the prompt has at least one token);
- a chat message's ``role``: the roles the chat template renders, plus ``system`` / ``developer`` (folded into the
  first user turn when the template refuses them; serve/inputs.py).

What still depends on the request itself (prompt + max_tokens over the context, a chat the template refuses for
its order) remains a 400 with a ``DEPLOYMENT_LIMIT_CODES`` code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dspark.serve.protocol import MAX_TOKENS_MARK, PROMPT_IDS_MARK, ROLE_MARK, TOKEN_ID_MARK


def _walk(node: Any, visit: Callable[[dict[str, Any]], None]) -> None:
    if isinstance(node, dict):
        visit(node)
        for v in node.values():
            _walk(v, visit)
    elif isinstance(node, list):
        for v in node:
            _walk(v, visit)


def served_limits(schema: dict[str, Any], vocab_size: int, max_model_len: int, roles: list[str]) -> dict[str, Any]:
    """Replace the markers in ``schema`` (in place; returned) with these limits."""

    def visit(s: dict[str, Any]) -> None:
        if s.pop(TOKEN_ID_MARK, False):
            s["maximum"] = vocab_size - 1
        if s.pop(PROMPT_IDS_MARK, False):
            s["maxItems"] = max_model_len - 1
        if s.pop(MAX_TOKENS_MARK, False):
            s["maximum"] = max_model_len - 1
        if s.pop(ROLE_MARK, False) and roles:
            s["enum"] = [r for r in s["enum"] if r in roles]

    _walk(schema, visit)
    return schema
