"""Tools that make test and benchmark checkpoints; no service imports them (tests/architecture/test_import_graph.py).

    make_model.py         `make_model()`: a random-weight Hugging Face checkpoint folder of one
                          family and preset, with its tokenizer and generation config
                          (`pagedserve make-model DIR --arch A --preset P [--config-only]`)
    make_vision_model.py  the vision-language parts of a `gemma3-vision` checkpoint: the Gemma3Config,
                          the SigLIP tower's weights, the processor (`make-model --arch gemma3-vision`)
    model_presets.py      what each `--preset` and `--arch` writes: sizes, each family's config
                          switches, chat flavours (special tokens, EOS ids, chat templates)
    local_tokenizer.py    the byte-level BPE `make-model` trains on the standard library's sources
    release_tokenizer.py  a tokenizer with the Gemma 3 releases' special tokens at their real ids
                          (`make-model --preset gemma-3-*-it --config-only`)
"""
