"""OpenAI's Responses API (`POST /v1/responses`), stateless: a request is translated into the
chat completion request it amounts to, served as chat is (same template, tools, grammar and
scheduler path), and answered as a `response` object or its stream of typed events. The
route is gateway/routes/responses.py.

    request.py   ResponsesRequest; `chat_body` / `chat_request` (the chat request it
                 amounts to), `echoed_fields` (what the response object repeats of the
                 request) and `as_responses_error` (a chat error named by the Responses fields)
    schema.py    the JSON Schema /openapi.json publishes for its dict-typed fields
                 (input items, tools, tool_choice, text)
    output.py    ResponsesFormat: the `response` object, or its typed SSE events, from the
                 chat request's Generation
"""
