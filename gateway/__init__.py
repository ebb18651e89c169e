"""The OpenAI-compatible HTTP gateway (DESIGN.md "One request's life", steps 1, 2 and 8).

    config.py        GatewayConfig; add_cli_args / config_from_args
    app.py           create_app(config) -> FastAPI: thin routes
    protocol.py      pydantic models of the OpenAI request schema
    response_models.py  pydantic models of the OpenAI response shapes (logprobs included)
    errors.py        OpenAI-shaped errors and the handlers that produce them
    auth.py          API keys: bearer check on /v1 before routing, constant-time compare
    metrics.py       Prometheus metrics (/metrics)
    preflight.py     body limit, parsing, model / live worker, tokenizing, context check, n fan-out
    tokenizer.py     the checkpoint's tokenizer and chat template
    detokenizer.py   incremental detokenization (tokenizers' DecodeStream)
    token_text.py    one token's text and bytes, for logprobs
    stop_strings.py  cutting text at stop strings, with hold-back while streaming
    backend.py       Redis: submit / abort, the reply-channel subscription, live workers
    generation.py    one request's life: submit, events, dedupe, text, stop, abort
    responses.py     completion and chat response / chunk shapes, logprobs, echo
    serving.py       the Generations of one request (n choices) as an SSE stream or one
                     JSON body; disconnect → abort
"""
