"""The OpenAI-compatible HTTP gateway (DESIGN.md "One request's life", steps 1, 2 and 8).

    config.py        GatewayConfig; add_cli_args / config_from_args
    app.py           create_app(config) -> FastAPI: thin routes
    protocol.py      pydantic models of the OpenAI request schema
    content_parts.py a chat message's content parts: text, image_url, video_url
    response_models.py  pydantic models of the OpenAI response shapes (logprobs included)
    errors.py        OpenAI-shaped errors and the handlers that produce them
    auth.py          API keys: bearer check on /v1 before routing, constant-time compare
    metrics.py       Prometheus metrics (/metrics)
    preflight.py     body limit, parsing, model / live worker, tokenizing, context check, n fan-out
    mm_prompt.py     a chat prompt with images / video: media loaded, template, pan-and-scan crops,
                     Gemma3Processor's expansion, each image's (and crop's) soft-token range
                     (NewRequest.mm_inputs)
    image_tokens.py  a vision checkpoint's image tokens, soft tokens per image and pan-and-scan
                     settings (None: text model)
    tokenizer.py     the checkpoint's tokenizer and chat template (or --chat-template's)
    sampling_defaults.py  generation_config.json's sampling defaults (--generation-config)
    detokenizer.py   incremental detokenization (tokenizers' DecodeStream)
    token_text.py    one token's text and bytes, for logprobs
    stop_strings.py  cutting text at stop strings, with hold-back while streaming
    backend.py       Redis: submit / abort, the reply-channel subscription, live workers
    event_queues.py  each request's queue of token events, bounded (a client that stops reading)
    generation.py    one request's life: submit, events, dedupe, text, stop, abort
    responses.py     completion and chat response / chunk shapes, logprobs, echo
    sse_chunks.py    text-only stream chunks from a template made once per choice
    serving.py       the Generations of one request (n choices) as an SSE stream or one
                     JSON body; disconnect → abort
    generation_group.py  several prompts of one /v1/completions request answered as one
    structured_output.py response_format / structured_outputs / guided_* → a checked Grammar
    tools.py         tools + tool_choice → a tool parser and, for forced calls, a grammar
    tool_parsers/    the call formats of model families (hermes, llama3_json, mistral) and of
                     forced calls; tool_calls and their stream deltas
    responses_request.py, responses_output.py   the Responses API (/v1/responses)
    tokenize_models.py   /tokenize and /detokenize shapes
    media/           images and video: fetch, check, decode, store by content hash (MediaLoader)
"""
