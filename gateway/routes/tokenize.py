"""vLLM's /tokenize and /detokenize (not OpenAI's API; shapes in gateway/tokenize_models.py):
a prompt's token ids as /v1/completions (`prompt`) or chat (`messages`) makes them, and ids
back to text. Neither reaches a worker; /tokenize names the live context length."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request

from gateway.errors import OpenAIError
from gateway.openapi_answers import BODY_ERRORS, TOKENIZE_BEYOND, error_responses
from gateway.preflight import parse, read_body
from gateway.routes.models import live_max_model_len
from gateway.tokenize_models import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                     TokenizeCompletionRequest, TokenizeResponse)

router = APIRouter()


@router.post("/tokenize", responses=error_responses(*BODY_ERRORS, 503, beyond=TOKENIZE_BEYOND))
async def tokenize(request: Request) -> TokenizeResponse:
    """vLLM's: a prompt's token ids as /v1/completions (`prompt`) or chat (`messages`) makes them."""
    state = request.app.state
    raw = await read_body(request, state.config.max_body_bytes)
    try:
        is_chat = "messages" in json.loads(raw)
    except (ValueError, TypeError):
        is_chat = False  # not a JSON object: parse() below says what is wrong
    body = parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, raw)
    state.preflight.check_model(body.model)
    if isinstance(body, TokenizeChatRequest) and any(m.has_media for m in body.messages):
        raise OpenAIError(400, "/tokenize does not take image or video parts yet; send the text "
                               "parts only.", param="messages", code="unsupported_content_part")
    if isinstance(body, TokenizeChatRequest):
        ids = await asyncio.to_thread(
            state.tokenizer.encode_chat, [m.template_dict() for m in body.messages],
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            add_generation_prompt=bool(body.add_generation_prompt),
            continue_final_message=bool(body.continue_final_message),
            template_kwargs=body.chat_template_kwargs or {}, add_special_tokens=bool(body.add_special_tokens))
    else:
        ids = await asyncio.to_thread(state.tokenizer.encode_text, body.prompt, bool(body.add_special_tokens))
    strs = [state.token_texts.text(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=await live_max_model_len(request),
                            tokens=ids, token_strs=strs)


@router.post("/detokenize", responses=error_responses(*BODY_ERRORS))
async def detokenize(request: Request) -> DetokenizeResponse:
    state = request.app.state
    body = parse(DetokenizeRequest, await read_body(request, state.config.max_body_bytes))
    state.preflight.check_model(body.model)
    state.tokenizer.check_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(state.tokenizer.decode, body.tokens))
