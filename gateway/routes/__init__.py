"""The gateway's HTTP routes, one `APIRouter` per surface, included by `create_app`
(gateway/app.py). Routes are thin: they read everything stateful from `request.app.state`
(config, tokenizer, token_texts, metrics, backend, preflight, files, ...) and leave the work
to Preflight (checks), Generation (the request's life) and serving (SSE or JSON).

    health.py       /health, /health/live, /health/ready; /metrics (not in /openapi.json)
    models.py       /v1/models, /v1/models/{model_id}; the model card shapes
    tokenize.py     /tokenize, /detokenize (vLLM's)
    completions.py  /v1/completions, /v1/chat/completions
    responses.py    /v1/responses (the Responses API: gateway/responses_api/)
    files.py        /v1/files (the Files API, the stack only: gateway/files/); a router per
                    app, its upload schema bounded by --file-ttl-s
    answer.py       what the generating routes share: admitted prompts → metered Generation →
                    SSE stream or one JSON body
"""
