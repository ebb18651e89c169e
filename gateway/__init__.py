"""The OpenAI-compatible HTTP gateway (DESIGN.md "One request's life", steps 1, 2 and 8).

The app and its routes
    config.py        GatewayConfig; add_cli_args / config_from_args
    app.py           create_app(config) -> FastAPI: app.state, the lifespan, middleware, the routers
    routes/          the routes, one APIRouter per surface: health.py (/health*, /metrics),
                     models.py, tokenize.py, completions.py (completions and chat),
                     responses.py (/v1/responses), files.py (/v1/files); answer.py: what the
                     generating routes share
    errors.py        OpenAI-shaped errors and the handlers that produce them
    auth.py          API keys: bearer check on /v1 before routing, constant-time compare
    metrics.py       Prometheus metrics (/metrics)
    gateway_metrics_peers.py  every live gateway's own metrics, published to Redis and summed
    readiness.py     whether a generate would succeed now, and if not why (/health/ready)
    admission.py     503 / 429 before a request is enqueued (no live scheduler, full queues)

Requests in
    protocol.py      pydantic models of the OpenAI request schema (completions, chat)
    request_part.py  the base of every request model: strict types, unknown fields kept
    chat_message.py  a chat message and a tool, as OpenAI's chat API defines them
    content_parts.py a chat message's content parts: text, image_url, video_url
    neutral_params.py  the parameters accepted only at their neutral value
    structured_output_request.py  response_format and structured_outputs, as requested
    schema_rules.py  rules across fields, written as JSON Schema
    tokenize_models.py   /tokenize and /detokenize shapes
    preflight.py     body limit, parsing, model / live worker, tokenizing, context check, n fan-out
    mm_prompt.py     a chat prompt with images / video: media loaded, template, pan-and-scan crops,
                     Gemma3Processor's expansion, each image's (and crop's) soft-token range
                     (NewRequest.mm_inputs)
    image_tokens.py  a vision checkpoint's image tokens, soft tokens per image and pan-and-scan
                     settings (None: text model)
    tokenizer.py     the checkpoint's tokenizer and chat template (or --chat-template's)
    sampling_defaults.py  generation_config.json's sampling defaults (--generation-config)
    structured_output.py response_format / structured_outputs / guided_* → a checked Grammar
    tools.py         tools + tool_choice → a tool parser and, for forced calls, a grammar
    tool_parsers/    the call formats of model families (hermes, llama3_json, mistral) and of
                     forced calls; tool_calls and their stream deltas
    media/           images and video: fetch, check, decode, store by content hash (MediaLoader)
    files/           the Files API's store: uploads kept in Redis as media items, per API key

A request's life
    backend.py       Redis: submit / abort, the reply-channel subscription, live workers
    shard_choice.py  which scheduler shard a request goes to: prefix affinity, bounded load
    event_queues.py  each request's queue of token events, bounded (a client that stops reading)
    generation.py    one request's life: submit, events, dedupe, text, stop, abort
    generation_group.py  several prompts of one /v1/completions request answered as one
    detokenizer.py   incremental detokenization (tokenizers' DecodeStream)
    token_text.py    one token's text and bytes, for logprobs
    stop_strings.py  cutting text at stop strings, with hold-back while streaming

Answers out
    completion_models.py  pydantic models of the text_completion / chat.completion bodies and
                     chunks, logprobs, usage
    completion_output.py  those bodies and chunks made from a Generation's outputs (completions
                     and chat formats behind one interface), logprobs, echo
    sse_chunks.py    text-only stream chunks from a template made once per choice
    serving.py       the Generations of one request (n choices) as an SSE stream or one
                     JSON body; disconnect → abort
    responses_api/   OpenAI's Responses API (/v1/responses): request.py (translated into a chat
                     request), schema.py (its fields as published), output.py (the response
                     object and its typed events)

The contract
    openapi_document.py  /openapi.json: request bodies, filled in for the served model and flags
    openapi_answers.py   what each route answers: error bodies, SSE events, the error codes
                         beyond the schema (FastAPI's `responses=`)
"""
