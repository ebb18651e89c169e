"""Gemma 3's bidirectional image spans (`bidir_spans`) in the Triton paged attention, against
the plain-torch reference: the layouts of tests/unit/kernels/test_bidirectional_attention.py on the CPU
in Triton's interpreter (`test_cases_in_triton_interpreter` reruns this file with
TRITON_INTERPRET=1), and images of 256 tokens (Gemma 3's `mm_tokens_per_image`) in contexts
of thousands compiled on CUDA (`gpu` marker); windows shorter and longer than an image, GQA,
half precision; a run that treats image tokens causally is caught; the mask is transformers'.
Shared with the other kernel tests: tests/support/triton_cases.py."""

import zlib

import pytest
import torch

from tests.support.triton_cases import (  # noqa: F401  (device, gen: fixtures)
    INTERPRETER,
    REL_TOL,
    check_attention,
    device,
    gen,
    llama_layout,
    make_batch,
    mixes,
    rel_error,
    run_in_interpreter,
)
from kernels import triton_attention, triton_tiles  # noqa: E402  (triton_cases skips without triton)
from kernels.reference import paged_attention_reference
from tests.unit.kernels.test_bidirectional_attention import (
    LAYOUTS,
    image_rows,
    probe_mask,
    random_layout,
    row_spans,
    transformers_mask,
)


# -- bidirectional spans (Gemma 3's images) --------------------------------------------------

# The CPU layouts' names at CUDA size: (seq_len, q_len, images [s, e)) per request, images
# of 256 tokens at the start, middle and end of chunks, behind cached context, across a
# prefix-cache hit (an image that starts in the cached context), beside decodes.
FULL_LAYOUTS = {
    "two_images_one_prefill": [(1500, 1500, [(30, 286), (700, 956)])],
    "start_middle_end_of_chunk": [(2048, 2048, [(0, 256), (1000, 1256), (1792, 2048)])],
    "second_chunk_after_context": [(2560, 512, [(100, 356), (2200, 2456)])],
    "prefix_hit_inside_image": [(1500, 1000, [(400, 656)]), (777, 300, [(300, 556), (560, 777)])],
    "mixed_with_decodes": [(3000, 1, [(10, 266)]), (1200, 1200, [(0, 256), (600, 856), (944, 1200)]),
                           (4000, 300, [(3744, 4000)]), (1, 1, []), (33, 1, []), (8192, 1, [(5, 261)]),
                           (513, 512, [(1, 257), (258, 513)])],
    "short_chunks": [(300, 6, [(44, 300)]), (270, 8, [(5, 261), (262, 270)]), (2000, 3, [(1740, 1999)])],
    "text_only_beside_images": [(1024, 1024, []), (2048, 512, []), (1030, 1030, [(4, 260)]), (99, 1, [])],
}
assert FULL_LAYOUTS.keys() == LAYOUTS.keys()


def image_layouts(device: str) -> dict:
    return LAYOUTS if device == "cpu" else FULL_LAYOUTS


def windows(device: str) -> dict:
    """Windows shorter and longer than an image (CUDA: Gemma 3's 1024 and a fraction)."""
    return {"short": 4, "long": 30} if device == "cpu" else {"short": 100, "long": 1024}


def image_batch(layout, *, gen, device, **kwargs):
    batch = make_batch([(s, q) for s, q, _ in layout], gen=gen, device=device, **kwargs)
    return batch, row_spans(layout).to(device)


@pytest.mark.parametrize("options", [{}, {"window": "short"}, {"window": "long", "soft_cap": 30.0}],
                         ids=["plain", "short-window", "long-window-cap"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_attention_with_images(device, gen, name, options):
    options = dict(options)
    if "window" in options:
        options["sliding_window"] = windows(device)[options.pop("window")]
    batch, spans = image_batch(image_layouts(device)[name], gen=gen, device=device,
                               **llama_layout(device))
    check_attention(batch, scale=1.0 if "soft_cap" in options else None, bidir_spans=spans, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["mixed_with_decodes", "prefix_hit_inside_image"])
def test_attention_with_images_half_precision(device, gen, name, dtype):
    batch, spans = image_batch(image_layouts(device)[name], gen=gen, device=device, dtype=dtype,
                               **llama_layout(device))
    check_attention(batch, bidir_spans=spans)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 1), (7, 1)], ids=["gqa3", "gqa8", "gqa7"])
def test_attention_with_random_images_and_gqa(device, gen, num_heads, num_kv_heads):
    """Random images (several per request, any size up to a few key tiles) over a mixed
    batch, with groups that fill the tile or leave rows over."""
    reqs = mixes(device)["mixed"] + mixes(device)["chunked_prefill"]
    layout = random_layout(zlib.crc32(str(num_heads).encode()), reqs,
                           max_image=12 if device == "cpu" else 300)
    scale = 1 if device == "cpu" else 4
    batch, spans = image_batch(layout, gen=gen, device=device, num_heads=num_heads * scale,
                               num_kv_heads=num_kv_heads * scale, head_dim=64)
    check_attention(batch, bidir_spans=spans)
    check_attention(batch, bidir_spans=spans, sliding_window=windows(device)["short"], soft_cap=20.0,
                    scale=1.0)


# Tile sets that put the diagonal, the window's edge and the images in separate key tiles or in
# one, and every tuned one (kernels/triton_tuned.json): each masked/unmasked split is exact.
TILE_SETS = sorted({(16, 16, 4, 1), (32, 16, 4, 2), (64, 32, 4, 2), (16, 64, 4, 3), (128, 32, 8, 2),
                    *((m, n, w, s) for m, n, w, s in triton_tiles.TUNED.values())})


@pytest.mark.parametrize("tiles", TILE_SETS, ids=["m{}-n{}-w{}-s{}".format(*t) for t in TILE_SETS])
@pytest.mark.parametrize("window", [None, "short", "long"])
def test_attention_with_images_in_every_tile_set(device, gen, tiles, window):
    layout = image_layouts(device)["mixed_with_decodes"] + image_layouts(device)["short_chunks"]
    batch, spans = image_batch(layout, gen=gen, device=device, **llama_layout(device))
    check_attention(batch, bidir_spans=spans, sliding_window=window and windows(device)[window],
                    tiles=dict(zip(triton_tiles.TILE_KEYS, tiles)))


@pytest.mark.parametrize("window", [None, "short"])
def test_attention_running_images_causally_is_caught(device, gen, window):
    """With the spans dropped, exactly the image rows before each image's last differ."""
    layout = image_layouts(device)["mixed_with_decodes"] + image_layouts(device)["short_chunks"]
    batch, spans = image_batch(layout, gen=gen, device=device, **llama_layout(device))
    sliding_window = None if window is None else windows(device)[window]
    with_spans = check_attention(batch, bidir_spans=spans, sliding_window=sliding_window)
    causal = check_attention(batch, sliding_window=sliding_window)
    inner, text = image_rows(layout)
    differs = ((with_spans - causal).abs().amax(dim=(1, 2)) > 1e-4).cpu()
    assert differs[inner].all(), [r for r in inner if not differs[r]]
    # text rows: the same keys (two compiled variants, so equal up to rounding)
    assert rel_error(with_spans[text], causal[text]) < 1e-6


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("q_len", [32, 20, 8, 1])
def test_attention_mask_with_images_is_transformers_gemma3_mask(device, window, q_len):
    seq_len, images = 32, [(4, 12), (17, 27), (28, 31)]
    spans = row_spans([(seq_len, q_len, images)]).to(device)

    def attend(query, k_cache, v_cache, bt, seq_lens, qsl):
        return triton_attention.paged_attention(query, k_cache, v_cache, bt, seq_lens, qsl, 1.0,
                                                sliding_window=window, bidir_spans=spans)

    got = probe_mask(attend, seq_len, q_len, device=device)
    assert torch.equal(got, transformers_mask(seq_len, images, window)[seq_len - q_len:])


def test_attention_with_images_never_reads_past_the_context(device, gen):
    """A span that ends past seq_len (a caller's bug: the contract forbids it) reads no key
    at or past seq_len (those slots are NaN here): the kernel clamps its key loop."""
    layout = [(40, 20, [(30, 40)]), (17, 1, [])]
    batch, spans = image_batch(layout, gen=gen, device=device)
    spans[10:20, 1] = 48  # rows of positions 30..39: their image "ends" at 48 > 40
    out = triton_attention.paged_attention(*batch, 0.2, bidir_spans=spans)
    assert torch.isfinite(out).all()
    fixed = spans.clone()
    fixed[10:20, 1] = 40
    ref = paged_attention_reference(*batch, 0.2, bidir_spans=fixed)
    assert rel_error(out, ref) < REL_TOL[torch.float32]


def test_attention_rejects_bad_spans(device):
    meta = (torch.zeros(1, 1, dtype=torch.int32, device=device),
            torch.tensor([3], dtype=torch.int32, device=device),
            torch.tensor([0, 3], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="int32"):
        triton_attention.plan_attention(*meta, 16, bidir_spans=torch.zeros(3, 3, dtype=torch.int32,
                                                                           device=device))
    plan = triton_attention.plan_attention(*meta, 16, bidir_spans=torch.zeros(3, 2, dtype=torch.int32,
                                                                              device=device))
    q = torch.zeros(3, 4, 32, device=device)
    cache = torch.zeros(1, 16, 2, 32, device=device)
    with pytest.raises(ValueError, match="plan"):
        triton_attention.paged_attention(q, cache, cache, *meta, 1.0, plan=plan,
                                         bidir_spans=plan.bidir_spans)
    with pytest.raises(ValueError, match="rows"):
        triton_attention.paged_attention(torch.zeros(4, 4, 32, device=device), cache, cache, *meta, 1.0,
                                         plan=plan)


# -- the interpreter run ---------------------------------------------------------------------

@pytest.mark.skipif(INTERPRETER, reason="this process is the interpreter run")
def test_cases_in_triton_interpreter():
    """Every non-gpu case above, on the CPU, in a subprocess with TRITON_INTERPRET=1."""
    run_in_interpreter(__file__)
