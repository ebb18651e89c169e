"""The model code: the decoder families, the vision encoder, checkpoint loading, and the
thread count they compute with. Imported by the worker (worker_svc/), the encoder service
(encoder_svc/), the vision path (vision/), the benchmarks and the tests; it imports no
service (tests/architecture/test_import_graph.py).

The decoder
    config.py             DecoderConfig: a family's config.json read into the shared
                          decoder's switches (`read_common`, DTYPES, `architecture_of`)
    registry.py           which family reads a checkpoint (`load_config`, `read_config`);
                          `load_vision_config` for a vision-language one
    llama.py, mistral.py, qwen2.py, qwen3.py, gemma3.py
                          one family each: ARCHITECTURES and `read_config`
    decoder.py            DecoderForCausalLM: the decoder every family runs, over the paged
                          KV cache (through kernels/backend.py's layer ops and attention)
    attention_metadata.py AttentionMetadata, GroupAttention: what the decoder's attention
                          reads of a step, built by worker_svc/input_batch.py
    layers.py             the building blocks (norms, RoPE, gated MLP, packed CPU linears),
                          in transformers' numerics
    image_placement.py    a request's image placeholders (PlaceholderRange), which of their
                          soft tokens a chunk holds at which rows, the image embeddings
                          written over those rows (worker_svc/batch.py, vision_step.py)
Gemma 3's vision encoder
    siglip.py             SiglipVisionTower: the SigLIP vision transformer
    gemma3_vision.py      Gemma3VisionEncoder: the tower and the multi-modal projector, images
                          in, one embedding per soft token out (`load_vision_encoder`)
Loading
    loader.py             `load_model`: a checkpoint folder -> a decoder on its device;
                          `resolve_dtype` (--dtype auto, from kernels/cpu_features.py)
    weight_names.py       which part of a vision-language checkpoint a tensor belongs to
    stacked_weights.py    checkpoint tensors into stacked q/k/v and gate/up parameters
    weight_memory.py      weights too large for the device refused before they are made
    dummy_weights.py      --load-format dummy: random weights of config.json's shapes
    int8_linear.py        --quantization int8: int8 linear layers, quantized at load
On the CPU
    cpu_threads.py        how many threads a CPU process computes with (`choose_threads`: the
                          worker and the encoder service at start; `CpuShare`: the worker's
                          count while serving, what other processes leave it)
"""
