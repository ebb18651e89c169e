"""Gemma 3's bidirectional attention over image tokens (`bidir_spans`, kernels/reference.py):
the reference's mask against the one transformers builds, and the torch and cpu backends
(the C kernel's short requests included) against the reference on batches where images sit
at the start, middle and end of prefill chunks, behind cached context, across a prefix-cache
hit, beside decodes; with GQA, soft caps, and windows shorter and longer than an image.
The Triton kernel's cases are in tests/unit/kernels/test_triton_bidirectional.py (same layouts)."""

import random

import pytest
import torch

from kernels import cpu_attention, torch_attention
from kernels.reference import paged_attention_reference
from tests.unit.kernels.test_cpu_kernel import portable_kernels
from tests.unit.kernels.test_kernels import FP32, make_case

# Per request: (seq_len, q_len, images), images as [s, e) absolute positions in the request.
# An image may lie in the cached context (no row of this step is in it), in the chunk, or
# start in the context and end in the chunk (a prefix-cache hit that ends inside the image:
# its first tokens' K/V are cached, computed with the whole image). Never past seq_len.
LAYOUTS = {
    "two_images_one_prefill": [(40, 40, [(3, 11), (20, 29)])],
    "start_middle_end_of_chunk": [(30, 30, [(0, 6), (12, 18), (24, 30)])],
    "second_chunk_after_context": [(64, 24, [(5, 13), (44, 56)])],
    "prefix_hit_inside_image": [(50, 20, [(25, 40)]), (33, 16, [(10, 20), (21, 33)])],
    "mixed_with_decodes": [(50, 1, [(10, 20)]), (37, 37, [(0, 5), (10, 20), (30, 37)]),
                           (90, 25, [(66, 76), (80, 90)]), (1, 1, []), (16, 1, [(3, 9)]),
                           (45, 20, [(26, 33), (34, 35)]), (7, 7, [(2, 5)])],
    # q_len <= SHORT_MAX_Q_LEN: the C kernel's requests, with images in them
    "short_chunks": [(30, 6, [(24, 30)]), (12, 8, [(5, 8), (9, 11)]), (20, 3, [(15, 19)]),
                     (9, 2, [(7, 9)]), (60, 1, [(50, 59)]), (41, 9, [(33, 40)]),
                     (17, cpu_attention.SHORT_MAX_Q_LEN, [(9, 17)])],
    "text_only_beside_images": [(40, 40, []), (48, 16, []), (30, 30, [(4, 12)]), (20, 1, [])],
}


def row_spans(layout) -> torch.Tensor:
    """int32 [num_tokens, 2]: each query row's image [s, e), or [0, 0]."""
    rows = []
    for seq_len, q_len, images in layout:
        for p in range(seq_len - q_len, seq_len):
            rows.append(next(([s, e] for s, e in images if s <= p < e), [0, 0]))
    return torch.tensor(rows, dtype=torch.int32).view(-1, 2)


def random_layout(seed: int, reqs, max_image: int):
    """Images of 1..max_image tokens at random places of each (seq_len, q_len) request, at
    least one text token apart (as <end_of_image> <start_of_image> keep them in a prompt)."""
    rng = random.Random(seed)
    layout = []
    for seq_len, q_len in reqs:
        images, p = [], rng.randrange(3)
        while p < seq_len:
            n = rng.randint(1, max_image)
            if rng.random() < 0.6 and p + n <= seq_len:
                images.append((p, p + n))
                p += n
            p += rng.randint(1, 6)
        layout.append((seq_len, q_len, images))
    return layout


def case_for(layout, seed, **kwargs):
    batch = make_case(seed, [(s, q) for s, q, _ in layout], **kwargs)
    return batch, row_spans(layout)


def image_rows(layout) -> tuple[list[int], list[int]]:
    """Query rows inside an image but not its last token (their keys change), and rows of
    text tokens (unchanged: a text row's keys are causal)."""
    inner, text, row = [], [], 0
    for seq_len, q_len, images in layout:
        for p in range(seq_len - q_len, seq_len):
            hit = [e for s, e in images if s <= p < e]
            if not hit:
                text.append(row)
            elif p < hit[0] - 1:
                inner.append(row)
            row += 1
    return inner, text


@pytest.fixture(scope="module", params=["torch", "cpu", "cpu-portable"])
def backend(request) -> cpu_attention.CpuKernels | None:
    """None: the torch backend; else the cpu backend's C kernel, as the worker builds it
    (-march=native) or without AVX-512 (its portable loops, on this CPU too)."""
    if request.param == "torch":
        return None
    if request.param == "cpu":
        return cpu_attention.CpuKernels()
    return portable_kernels()


def run_backend(kernels: cpu_attention.CpuKernels | None, batch, scale, spans, **options):
    """The torch backend (kernels None) or the cpu one, through a plan with `spans`."""
    query, k_cache, v_cache, bt, seq_lens, qsl = batch
    out = torch.full_like(query, float("nan"))
    if kernels is None:
        plan = torch_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1],
                                              options.get("sliding_window"), bidir_spans=spans)
        return torch_attention.paged_attention(query, k_cache, v_cache, bt, seq_lens, qsl, scale,
                                               plan=plan, out=out, **options)
    plan = cpu_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1],
                                        options.get("sliding_window"), bidir_spans=spans)
    return cpu_attention.paged_attention(kernels, query, k_cache, v_cache, bt, seq_lens, qsl, scale,
                                         plan=plan, out=out, **options)


# -- the mask, against transformers -----------------------------------------------------------

def probe_mask(attend, seq_len: int, q_len: int, block_size: int = 8,
               device: str = "cpu") -> torch.Tensor:
    """bool [q_len, seq_len]: which keys each of the last q_len rows of a one-request batch
    sees, read off an attention call `attend(query, k_cache, v_cache, bt, seq_lens, qsl)`:
    zero keys make every visible score equal, and value k is one-hot at k, so a row's
    output is uniform over exactly the keys it sees."""
    num_blocks = -(-seq_len // block_size)
    head_dim = max(16, seq_len)
    k_cache = torch.zeros(num_blocks, block_size, 1, head_dim, device=device)
    v_cache = torch.zeros(num_blocks * block_size, 1, head_dim, device=device)
    keys = torch.arange(seq_len, device=device)
    v_cache[keys, 0, keys] = 1.0
    v_cache = v_cache.view(num_blocks, block_size, 1, head_dim)
    bt = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    query = torch.randn(q_len, 2, head_dim, device=device)  # two query heads over one kv head
    out = attend(query, k_cache, v_cache, bt, torch.tensor([seq_len], dtype=torch.int32, device=device),
                 torch.tensor([0, q_len], dtype=torch.int32, device=device)).cpu()
    assert torch.equal(out[:, 0], out[:, 1])
    return out[:, 0, :seq_len] > 1e-6


def transformers_mask(seq_len: int, images, sliding_window: int | None) -> torch.Tensor:
    """transformers' own Gemma 3 mask for one sequence with `images` ([s, e) runs of image
    tokens, token_type_ids 1): the "full_attention" one (window None) or the
    "sliding_attention" one, bool [seq_len, seq_len] (query, key)."""
    import transformers
    from transformers import Gemma3TextConfig

    try:
        from transformers.models.gemma3.modeling_gemma3 import (
            create_masks_for_vision_model,
            get_block_sequence_ids_for_mask,
        )
    except ImportError:  # e.g. a GPU image's older transformers
        pytest.skip(f"transformers {transformers.__version__} builds Gemma 3's mask another way")

    token_type_ids = torch.zeros(1, seq_len, dtype=torch.long)
    for s, e in images:
        token_type_ids[0, s:e] = 1
    config = Gemma3TextConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                              sliding_window=sliding_window or 10 * seq_len)
    config._attn_implementation = "sdpa"
    masks = create_masks_for_vision_model(
        config, torch.zeros(1, seq_len, 8), None, None, torch.arange(seq_len)[None],
        get_block_sequence_ids_for_mask(token_type_ids))
    mask = masks["full_attention" if sliding_window is None else "sliding_attention"]
    return (mask if mask.dtype == torch.bool else mask == 0)[0, 0]


TWO_IMAGES = (32, [(4, 12), (17, 27)])  # seq_len, images: text 0-3, 12-16, 27-31


@pytest.mark.parametrize("window", [None, 3, 6, 20], ids=["global", "w3", "w6", "w20"])
@pytest.mark.parametrize("chunks", [[32], [12, 20], [4, 13, 15]], ids=["one", "two", "three"])
def test_reference_mask_is_transformers_gemma3_mask(window, chunks):
    """Global layers: OR(causal, same image); sliding layers: AND(window, OR(causal, same
    image)), as transformers' create_masks_for_vision_model builds them; with the prompt
    in one prefill or in chunks that cut no image (12 | 20: after cached text and image
    one; 4 | 13 | 15). Windows shorter than both images, than one, and longer than both."""
    seq_len, images = TWO_IMAGES
    want = transformers_mask(seq_len, images, window)
    done = 0
    for q_len in chunks:
        done += q_len
        layout = [(done, q_len, images)]
        spans = row_spans(layout)

        def attend(*batch):
            return paged_attention_reference(*batch, 1.0, sliding_window=window, bidir_spans=spans)

        got = probe_mask(attend, done, q_len)
        assert torch.equal(got, want[done - q_len:done, :done]), (q_len, got.int(), want.int())
    assert not torch.equal(want, torch.ones_like(want).tril())  # the images do change it


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("q_len", [32, 20, 8, 1], ids=["prefill", "chunk", "short_chunk", "decode"])
def test_backend_masks_are_transformers_gemma3_mask(backend, window, q_len):
    """Each backend's visible keys (read as in probe_mask) are transformers' mask rows, for
    a whole prefill, a chunk after cached context, a short chunk (the C kernel) that starts
    inside the second image (a prefix-cache hit there), and a decode."""
    seq_len, images = 32, [(4, 12), (17, 27), (28, 31)]
    layout = [(seq_len, q_len, images)]
    spans = row_spans(layout)
    want = transformers_mask(seq_len, images, window)[seq_len - q_len:]

    def attend(query, k_cache, v_cache, bt, seq_lens, qsl):
        return run_backend(backend, (query, k_cache, v_cache, bt, seq_lens, qsl), 1.0, spans,
                           sliding_window=window)

    assert torch.equal(probe_mask(attend, seq_len, q_len), want)


# -- the backends, against the reference -------------------------------------------------------

@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("options", [{}, {"sliding_window": 4}, {"sliding_window": 30, "soft_cap": 3.0},
                                     {"soft_cap": 5.0}], ids=["plain", "w4", "w30-cap", "cap"])
def test_backends_match_reference_with_images(backend, name, options):
    """Windows of 4 (shorter than most images: a row sees its image's later keys but not
    its earlier far ones) and 30 (longer than every image)."""
    layout = LAYOUTS[name]
    for seed, (block_size, heads) in enumerate([(8, (8, 2)), (5, (6, 3)), (16, (4, 4))]):
        batch, spans = case_for(layout, seed, block_size=block_size, num_heads=heads[0],
                                num_kv_heads=heads[1], head_dim=64)
        ref = paged_attention_reference(*batch, 0.125, bidir_spans=spans, **options)
        out = run_backend(backend, batch, 0.125, spans, **options)
        torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize("seed", range(4))
def test_backends_match_reference_on_random_images(backend, seed):
    """Random images (1..12 tokens, several per request) over a mixed batch: prefills,
    chunks after cached context, short chunks, decodes; GQA; a window shorter than the
    longer images, or none."""
    reqs = [(70, 70), (90, 30), (45, 8), (33, 3), (60, 1), (25, 1), (12, 12), (129, 40)]
    layout = random_layout(seed, reqs, max_image=12)
    batch, spans = case_for(layout, 100 + seed, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64)
    for options in ({}, {"sliding_window": 6, "soft_cap": 4.0}):
        ref = paged_attention_reference(*batch, 0.125, bidir_spans=spans, **options)
        out = run_backend(backend, batch, 0.125, spans, **options)
        torch.testing.assert_close(out, ref, **FP32)


def test_bf16_with_images(backend):
    batch, spans = case_for(LAYOUTS["mixed_with_decodes"] + LAYOUTS["short_chunks"], 3,
                            head_dim=64, dtype=torch.bfloat16)
    ref = paged_attention_reference(*batch, 0.125, bidir_spans=spans)
    out = run_backend(backend, batch, 0.125, spans)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max() / ref.float().abs().max() < 2e-2


@pytest.mark.parametrize("reference", [True, False], ids=["reference", "backend"])
@pytest.mark.parametrize("window", [None, 4])
def test_running_images_causally_is_caught(backend, reference, window):
    """The spans change exactly the rows of an image's tokens before its last (they see
    the image's later tokens) and no text row: with the spans dropped (image tokens run
    causally, as vLLM's first Gemma 3 did) those rows differ, so this fails."""
    layout = LAYOUTS["mixed_with_decodes"] + LAYOUTS["short_chunks"]
    batch, spans = case_for(layout, 9, head_dim=64)
    options = {"sliding_window": window}
    if reference:
        with_spans = paged_attention_reference(*batch, 0.125, bidir_spans=spans, **options)
        causal = paged_attention_reference(*batch, 0.125, **options)
    else:
        with_spans = run_backend(backend, batch, 0.125, spans, **options)
        causal = run_backend(backend, batch, 0.125, None, **options)
    inner, text = image_rows(layout)
    assert len(inner) > 20 and len(text) > 20
    differs = (with_spans - causal).abs().amax(dim=(1, 2)) > 1e-4
    assert differs[inner].all(), [r for r in inner if not differs[r]]
    torch.testing.assert_close(with_spans[text], causal[text], atol=0, rtol=0)


# -- the plans -----------------------------------------------------------------------------

def test_spans_that_change_nothing_leave_the_plans_as_without():
    """Empty spans, and spans only on decode rows (their row is the context's last): the
    torch plan keeps SDPA's causal fast path, the cpu plan hands the C kernel no spans."""
    layout = [(40, 40, []), (48, 16, []), (50, 1, [(10, 50)]), (20, 3, [(19, 20)])]
    batch, spans = case_for(layout, 1)
    _, k_cache, _, bt, seq_lens, qsl = batch
    plan = torch_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], bidir_spans=spans)
    assert plan.prefills[0].mask is None
    cpu_plan = cpu_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], bidir_spans=spans)
    assert cpu_plan.bidir_spans is None and cpu_plan.long.prefills[0].mask is None
    layout[3] = (20, 3, [(18, 20)])  # row 18 of the short request now sees key 19
    _, spans = case_for(layout, 1)
    cpu_plan = cpu_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], bidir_spans=spans)
    assert cpu_plan.bidir_spans is not None and cpu_plan.long.prefills[0].mask is None


@pytest.mark.parametrize("bad_row,span,match", [
    (5, [3, 5], "position 5"),  # ends before its row
    (5, [6, 9], "position 5"),  # starts after its row
    (5, [0, 41], "context 40"),  # past seq_len
    (5, [7, 2], "span"),  # reversed
    (5, [-1, 8], "span"),
])
def test_plans_refuse_spans_that_break_the_contract(bad_row, span, match):
    batch, spans = case_for([(40, 40, [(2, 10)]), (9, 1, [])], 1)
    spans[bad_row] = torch.tensor(span)
    _, k_cache, _, bt, seq_lens, qsl = batch
    for plan in (torch_attention.plan_attention, cpu_attention.plan_attention):
        with pytest.raises(ValueError, match=match):
            plan(bt, seq_lens, qsl, k_cache.shape[1], bidir_spans=spans)
    with pytest.raises(ValueError, match="int32"):
        torch_attention.plan_attention(bt, seq_lens, qsl, k_cache.shape[1], bidir_spans=spans[:-1])


def test_spans_without_a_plan_and_not_twice():
    """paged_attention(bidir_spans=...) plans them itself; given a plan as well, it refuses
    (the plan carries the spans its layers share)."""
    batch, spans = case_for(LAYOUTS["mixed_with_decodes"], 2, head_dim=64)
    query, k_cache, v_cache, bt, seq_lens, qsl = batch
    ref = paged_attention_reference(*batch, 0.2, bidir_spans=spans)
    torch.testing.assert_close(torch_attention.paged_attention(*batch, 0.2, bidir_spans=spans), ref, **FP32)
    torch.testing.assert_close(cpu_attention.paged_attention(cpu_attention.CpuKernels(), *batch, 0.2,
                                                             bidir_spans=spans), ref, **FP32)
    with pytest.raises(ValueError, match="plan"):
        torch_attention.paged_attention(*batch, 0.2, bidir_spans=spans,
                                        plan=torch_attention.plan_attention(bt, seq_lens, qsl, 16))
