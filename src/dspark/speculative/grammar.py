"""Structured outputs: a grammar (JSON schema, regex, choice, Lark / GBNF) masks the target's distribution.

The engine is llguidance (``LLMatcher``: an Earley parser over a lexer, masks computed lazily per step, with
rollback); docs/architecture.md says why it was chosen over xgrammar. One ``GrammarCompiler`` per engine holds the
tokenizer's byte strings; one ``GrammarMatcher`` per request follows its generated tokens.

In a verification round [anchor, d_1..d_L], row j decides the token after d_j, so its mask is the matcher's after
consuming d_1..d_j: the mask plain decoding would use after accepting those drafts. A draft the grammar refuses
has probability 0 under the masked row before it, so it is rejected (and the rows after it are never used); the
matcher then rolls back every draft, and consumes what was committed at the start of the next round.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Protocol

import torch

from dspark.sampling_params import StructuredOutput


class GrammarError(ValueError):
    """A schema, regex or grammar the engine cannot compile; the message names the field and why."""


def _llguidance():
    import llguidance

    return llguidance


class _ByteVocab:
    """llguidance's tokenizer interface for ``ByteTokenizer`` (random test models): ids below ``offset`` are
    special, every other id is the one byte it decodes to."""

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        off = tokenizer.offset
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos_token_id
        self.tokens = [f"<|{i}|>".encode() if i < off else bytes([(i - off) % 256]) for i in range(vocab_size)]
        self.special_token_ids = list(range(off))
        self._offset = off

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return [self._offset + b for b in data]


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of a structured-output request (not yet compiled: the matcher compiles it)."""
    lib = _llguidance().LLMatcher
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = json.loads(so.json) if kind == "json" else {"type": "object"}
        try:
            return lib.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            )
        except ValueError as e:
            raise GrammarError(f"structured output json: not a JSON schema object ({e})") from None
    if kind == "regex":
        return lib.grammar_from_regex(so.regex)
    if kind == "choice":
        return lib.grammar_from_regex("|".join(re.escape(c) for c in so.choice))
    text = so.grammar
    if "::=" in text:  # GBNF / EBNF (llama.cpp, xgrammar): llguidance's converter to Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises bare Exceptions for grammar errors
            raise GrammarError(f"structured output grammar: {e}") from None
    return lib.grammar_from_lark(text)


class GrammarCompiler:
    """The tokenizer as llguidance sees it (built once: ~0.8 s for a 49k vocabulary), and matchers for requests."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        lib = _llguidance()
        eos = sorted(eos_ids)
        if hasattr(tokenizer, "backend"):  # HFTokenizer: tokenizer.json as the tokenizers library writes it
            self.tok = lib.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)
        else:
            if tokenizer.offset + 256 > vocab_size:  # the byte tokenizer wraps bytes onto other bytes' ids
                raise GrammarError(
                    f"structured outputs need a vocabulary that can spell every byte; this random test model's "
                    f"byte vocabulary has {vocab_size} ids (at least {tokenizer.offset + 256} needed)"
                )
            wrapped = lib.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size, eos[0] if eos else 0))
            self.tok = lib.LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self.eos_ids = eos

    def matcher(self, so: StructuredOutput) -> GrammarMatcher:
        lib = _llguidance()
        m = lib.LLMatcher(self.tok, grammar_text(so), log_level=0)
        if m.is_error():
            raise GrammarError(f"structured output {so.kind}: {m.get_error()}")
        matcher = GrammarMatcher(m, self.vocab_size, self.eos_ids)
        matcher.round_masks([], [], 1)  # raises when no token of the vocabulary can start the output
        return matcher


class GrammarMatcher:
    """One request's grammar state: ``consumed`` of its generated tokens are in the matcher."""

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.m = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_ids = list(eos_ids)
        self.consumed = 0

    def sync(self, output_ids: Sequence[int]) -> None:
        """Consume the tokens committed since the last round."""
        new = list(output_ids[self.consumed :])
        if new and self.m.is_stopped():  # the grammar ended; with ignore_eos generation went on past it
            new = []
        if new and not self.m.consume_tokens(new):
            raise GrammarError(f"generated tokens {new} do not match the grammar: {self.m.get_error()}")
        self.consumed = len(output_ids)

    def _fill(self, row: torch.Tensor) -> None:
        self.m.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)

    def round_masks(self, output_ids: Sequence[int], drafts: Sequence[int], rows: int) -> torch.Tensor:
        """Packed masks [rows, words] int32 of a round: row j after the committed tokens and d_1..d_j. Rows after
        a draft the grammar refuses repeat the last valid row (they are never used: that draft is rejected)."""
        self.sync(output_ids)
        bits = torch.zeros(rows, self.words, dtype=torch.int32)
        self._fill(bits[0])
        stuck = not self.m.is_accepting() and not self.m.is_stopped() and not self._continues(bits[0])
        if stuck or self.m.is_error():  # llguidance: an error state ("NoExtensionBias") when no token fits
            why = self.m.get_error().split("\n", 1)[0]
            raise GrammarError(
                f"structured output: no token of this model's vocabulary continues the output here (after "
                f"{self.consumed} tokens{': ' + why if why else ''}); the grammar asks for text the tokenizer "
                "cannot produce"
            )
        taken = 0
        for j in range(1, rows):
            d = drafts[j - 1] if j - 1 < len(drafts) else -1
            if not (0 <= d < self.vocab_size and _allowed(bits[j - 1], d)) or not self.m.consume_token(d):
                bits[j:] = bits[j - 1]
                break
            taken += 1
            self._fill(bits[j])
        if taken:
            self.m.rollback(taken)
        return bits

    def _continues(self, row: torch.Tensor) -> bool:
        """Whether the packed mask allows a token other than EOS (which ends an unfinished output)."""
        other = row.clone()
        for e in self.eos_ids:
            if e < self.vocab_size:
                other[e // 32] &= ~(1 << (e % 32))
        return bool(other.any())

    def unpack(self, bits: torch.Tensor) -> torch.Tensor:
        """Packed masks [..., words] int32 -> allowed [..., V] bool; a row allowing nothing (a grammar that has
        ended, with EOS ignored) allows EOS, so that no distribution is empty."""
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., : self.vocab_size]
        if self.eos_ids:
            allowed[..., self.eos_ids[0]] |= ~allowed.any(-1)
        return allowed


def _allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


class Constrained(Protocol):  # an engine Request, as far as masking goes
    grammar: GrammarMatcher | None
    output_ids: list[int]


def grammar_masks(
    reqs: Sequence[Constrained], rows: int, drafts: list[list[int]] | None, vocab: int
) -> torch.Tensor | None:
    """[B, rows, V] bool: what each request's grammar allows at each row of the round (all tokens without one)."""
    if not any(r.grammar is not None for r in reqs):
        return None
    allowed = torch.ones(len(reqs), rows, vocab, dtype=torch.bool)
    for i, r in enumerate(reqs):
        if r.grammar is not None:
            bits = r.grammar.round_masks(r.output_ids, drafts[i] if drafts is not None else [], rows)
            allowed[i] = r.grammar.unpack(bits)
    return allowed
