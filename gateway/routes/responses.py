"""/v1/responses: OpenAI's Responses API (gateway/responses_api/), stateless. The body becomes
the chat request it amounts to, admitted as /v1/chat/completions admits one (its errors
renamed into the Responses fields), and answered by the same `answer` as chat
(gateway/routes/answer.py): one `response` object, or its typed events."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.errors import OpenAIError
from gateway.media.uuids import media_scope
from gateway.openapi_answers import (GENERATE_ERRORS, RESPONSES_BEYOND, error_responses, json_or_event_stream,
                                     response_events)
from gateway.preflight import parse, read_body
from gateway.responses_api.output import ResponseObject, ResponsesFormat
from gateway.responses_api.request import ResponsesRequest, as_responses_error, chat_request, echoed_fields
from gateway.routes.answer import answer

router = APIRouter()


@router.post("/v1/responses", responses={**json_or_event_stream(ResponseObject, response_events("ResponseObject")),
                                         **error_responses(*GENERATE_ERRORS, 501, beyond=RESPONSES_BEYOND)})
async def responses(request: Request) -> Response:
    """OpenAI's Responses API, stateless: served as the chat request it amounts to."""
    state = request.app.state
    body = parse(ResponsesRequest, await read_body(request, state.config.max_body_bytes))
    scope = media_scope(request.headers.get("authorization"), keyed=bool(state.config.api_keys))
    try:
        admitted = await state.preflight.admit_chat(chat_request(body), scope)
    except OpenAIError as exc:
        raise as_responses_error(exc, body) from None
    fmt = ResponsesFormat(f"resp_{admitted.request_id.partition('-')[2]}", state.config.model_name,
                          echoed_fields(body), admitted.tool_parser)
    return await answer(request, [admitted], fmt, stream=fmt.stream if body.stream else None)
