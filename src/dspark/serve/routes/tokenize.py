"""POST /tokenize (a prompt or a chat, as the generation routes would encode it) and POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter

from dspark.serve.errors import APIError
from dspark.serve.inputs import encode_prompt, render_chat
from dspark.serve.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from dspark.serve.state import ServerState, State

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: State) -> TokenizeResponse:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of 'prompt' (a string) or 'messages' (a chat)", param="prompt")
    ids = await state.off_loop(_encode, state, req)
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids)


def _encode(state: ServerState, req: TokenizeRequest) -> list[int]:
    text = req.prompt if req.prompt is not None else render_chat(state.engine, req.messages or [])
    explicit = req.prompt is not None or "add_special_tokens" in req.model_fields_set  # chat default: vLLM's False
    return encode_prompt(state.engine, text, req.add_special_tokens and explicit)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: State) -> DetokenizeResponse:
    state.check_model(req.model)
    vocab = state.engine.target.config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=await state.off_loop(state.engine.tokenizer.decode, list(req.tokens)))
