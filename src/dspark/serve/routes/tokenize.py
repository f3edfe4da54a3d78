"""POST /tokenize (a prompt or a chat, as the generation routes would encode it) and POST /detokenize."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from dspark.serve.errors import BODY_ERRORS
from dspark.serve.inputs import check_token_ids, encode_prompt, render_chat
from dspark.serve.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeCompletionRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from dspark.serve.state import ServerState, State

router = APIRouter()


@router.post("/tokenize", responses=BODY_ERRORS)
async def tokenize(req: Annotated[TokenizeRequest, Body()], state: State) -> TokenizeResponse:
    state.check_model(req.model)
    ids = await state.off_loop(_encode, state, req)
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids)


def _encode(state: ServerState, req: TokenizeRequest) -> list[int]:
    """A prompt gets the special tokens /v1/completions adds; a chat, the template's own (vLLM's defaults)."""
    text = req.prompt if isinstance(req, TokenizeCompletionRequest) else render_chat(state.engine, req.messages)
    return encode_prompt(state.engine, text, req.add_special_tokens)


@router.post("/detokenize", responses=BODY_ERRORS)
async def detokenize(req: DetokenizeRequest, state: State) -> DetokenizeResponse:
    state.check_model(req.model)
    check_token_ids(state.engine, req.tokens, "tokens")
    return DetokenizeResponse(prompt=await state.off_loop(state.engine.tokenizer.decode, list(req.tokens)))
