"""The OpenAI-compatible HTTP gateway (DESIGN.md "One request's life", steps 1, 2 and 8).

    config.py        GatewayConfig; add_cli_args / config_from_args
    app.py           create_app(config) -> FastAPI: thin routes
    protocol.py      pydantic models of the OpenAI request/response schema
    errors.py        OpenAI-shaped errors and the handlers that produce them
    preflight.py     body limit, parsing, API key, model / live worker, tokenizing, context check
    tokenizer.py     the checkpoint's tokenizer and chat template
    detokenizer.py   incremental detokenization (tokenizers' DecodeStream)
    stop_strings.py  cutting text at stop strings, with hold-back while streaming
    backend.py       Redis: submit / abort, the reply-channel subscription, live workers
    generation.py    one request's life: submit, events, dedupe, text, stop, abort
    responses.py     completion and chat response / chunk shapes
    serving.py       a Generation as an SSE stream or one JSON body; disconnect → abort
"""
