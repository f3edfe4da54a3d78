"""The logprobs objects of the OpenAI responses, from the engine's ``TokenLogprobs`` (the target's raw
distribution: the log-softmax of its logits before temperature, penalties and logit_bias). A token's text is the
tokenizer's text of that token alone (special tokens included)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from dspark.serve.protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs
from dspark.speculative.logprobs import TokenLogprobs


def completion_logprobs(
    tokenizer, ids: Sequence[int], entries: Sequence[TokenLogprobs | None], offset: int = 0
) -> CompletionLogprobs:
    """Tokens ``ids`` with their entries (None: an echoed prompt's first token); ``offset``: the character offset of
    the first token in the choice's text. ``top_logprobs`` holds the top-k by text and the token itself (vLLM's)."""
    texts = tokenizer.token_strings(ids)
    tops: list[dict[str, float] | None] = []
    for text, e in zip(texts, entries):
        if e is None:
            tops.append(None)
            continue
        top = dict(reversed(list(zip(tokenizer.token_strings([t for t, _ in e.top]), (lp for _, lp in e.top)))))
        tops.append(top | ({text: e.logprob} if e.top and text not in top else {}))  # reversed: the best text wins
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[None if e is None else e.logprob for e in entries],
        top_logprobs=tops,
        text_offset=list(itertools.accumulate((len(t) for t in texts[:-1]), initial=offset)) if texts else [],
    )


def _chat_entry(text: str, logprob: float) -> ChatTopLogprob:
    return ChatTopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(tokenizer, ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
    texts = tokenizer.token_strings(ids)
    content = []
    for text, e in zip(texts, entries):
        names = tokenizer.token_strings([t for t, _ in e.top])
        top = [_chat_entry(n, lp) for n, (_, lp) in zip(names, e.top)]
        content.append(ChatTokenLogprob(**_chat_entry(text, e.logprob).model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)
