"""Qwen2.5-VL against Hugging Face transformers (float32, CPU): preprocessing, logits, greedy tokens."""

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vramshard import Engine
from vramshard.errors import InvalidInputError
from vramshard.layers.rotary import apply_rotary, apply_rotary_float32
from vramshard.layers.vision import segment_attention, _group_segments
from vramshard.loading.image import (IMAGE_PAD, ImageConfig, expand_image_text, expand_image_tokens, load_image,
                                     preprocess_images)
from vramshard.models import model_args

VOCAB, IMAGE, START, END = 300, 290, 288, 289
MAX_PIXELS = 28 * 28 * 300


def tiny_config(**text):
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, initializer_range=0.1,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                         **text),
        # Windows of 2x2 merge groups (16 patches), one full-attention block of three.
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1], initializer_range=0.1),
        image_token_id=IMAGE, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_config()).eval()
    model.save_pretrained(path)
    return path, model


def random_image(height, width, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels) if channels > 1 else (height, width), dtype=np.uint8)
    return Image.fromarray(data, mode)


def prompt_for(inputs, texts=((5, 6), (7, 8), (9, 10, 11))):
    """text, <|vision_start|><|image_pad|>...<|vision_end|>, text, ... with the pads expanded."""
    ids = list(texts[0])
    for i in range(len(inputs.image_grid_thw)):
        ids += [START, IMAGE, END] + list(texts[i + 1])
    return expand_image_tokens(ids, IMAGE, inputs.tokens_per_image(2))


def hf_forward(model, ids, inputs=None):
    t = torch.tensor([ids])
    kw = {}
    if inputs is not None:
        kw = dict(pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                  mm_token_type_ids=(t == IMAGE).int())
    with torch.no_grad():
        return model(input_ids=t, **kw).logits[0], kw


IMAGES = {"one": [(140, 196)], "two": [(140, 196), (84, 112)]}


@pytest.mark.parametrize("case", list(IMAGES))
def test_logits_match_transformers(case, tiny_vl):
    path, model = tiny_vl
    inputs = preprocess_images([random_image(h, w, seed=i) for i, (h, w) in enumerate(IMAGES[case])],
                               ImageConfig(max_pixels=MAX_PIXELS))
    ids = prompt_for(inputs)
    expected, _ = hf_forward(model, ids, inputs)
    engine = Engine.load(path, device="cpu")
    got = engine.logits(ids, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # The test can tell: images and multimodal positions change the logits well beyond the tolerance.
    assert (engine.logits(ids) - expected).abs().max() > 1e-2
    # Chunked prefill (image rows split across steps) gives the same.
    chunked = Engine.load(path, device="cpu", max_step_tokens=16)
    torch.testing.assert_close(chunked.logits(ids, pixel_values=inputs.pixel_values,
                                              image_grid_thw=inputs.image_grid_thw), expected, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_transformers(tiny_vl):
    path, model = tiny_vl
    inputs = preprocess_images([random_image(140, 196, seed=3), random_image(84, 112, seed=4)],
                               ImageConfig(max_pixels=MAX_PIXELS))
    ids = prompt_for(inputs)
    _, kw = hf_forward(model, ids, inputs)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **kw)
    expected = out[0, len(ids):].tolist()
    engine = Engine.load(path, device="cpu")
    got = engine.generate([ids], max_new_tokens=16, pixel_values=inputs.pixel_values,
                          image_grid_thw=inputs.image_grid_thw)
    assert got == [expected]


def test_batched_prompts_with_images_equal_single(tiny_vl):
    path, _ = tiny_vl
    engine = Engine.load(path, device="cpu")
    config = ImageConfig(max_pixels=MAX_PIXELS)
    a = preprocess_images([random_image(140, 196, seed=5)], config)
    b = preprocess_images([random_image(84, 112, seed=6)], config)
    ids_a, ids_b = prompt_for(a), prompt_for(b, texts=((12,), (13, 14, 15, 16)))
    single = [engine.generate([ids], 8, pixel_values=x.pixel_values, image_grid_thw=x.image_grid_thw)[0]
              for ids, x in ((ids_a, a), (ids_b, b))]
    batched = engine.generate([ids_a, ids_b], 8, pixel_values=torch.cat([a.pixel_values, b.pixel_values]),
                              image_grid_thw=torch.cat([a.image_grid_thw, b.image_grid_thw]))
    assert batched == single


def test_text_only_prompt_matches_transformers(tiny_vl):
    path, model = tiny_vl
    ids = [5, 17, 42, 3, 77, 12, 9, 60, 31, 2, 88, 14]
    expected, _ = hf_forward(model, ids)
    engine = Engine.load(path, device="cpu")
    torch.testing.assert_close(engine.logits(ids), expected, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert engine.generate([ids], max_new_tokens=16) == [out[0, len(ids):].tolist()]


def test_preprocessing_matches_transformers(tmp_path):
    images = [random_image(123, 171), random_image(300, 90, "RGBA", seed=1), random_image(40, 50, "L", seed=2),
              random_image(1000, 700, seed=3)]  # the last is scaled down to max_pixels, the third up
    png, jpeg = tmp_path / "a.png", tmp_path / "b.jpg"
    images[0].save(png)
    images[3].save(jpeg, quality=90)
    sources = [png, _encoded(images[1], "PNG"), images[2], jpeg]  # a path, bytes, a PIL image, a path
    reference_images = [Image.open(png), images[1], images[2], Image.open(jpeg)]
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=MAX_PIXELS)
    expected = processor(images=reference_images, return_tensors="pt")
    got = preprocess_images(sources, ImageConfig(max_pixels=MAX_PIXELS))
    assert torch.equal(got.image_grid_thw, expected["image_grid_thw"])
    assert got.pixel_values.dtype == torch.float32
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)


def _encoded(image, fmt):
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def test_tiled_attention_equals_untiled_and_reference():
    torch.manual_seed(0)
    lengths = [16, 16, 8, 16, 4]
    q, k, v = (torch.randn(sum(lengths), 2, 8) for _ in range(3))
    segments = _group_segments(lengths)
    whole = segment_attention(q, k, v, segments, tile_queries=False)
    tiled = segment_attention(q, k, v, segments, tile_queries=True, max_score_bytes=64)  # a few rows per tile
    # Reference: a materialized block-diagonal mask over all tokens.
    segment_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = segment_of[:, None] == segment_of[None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiled, ref, rtol=1e-5, atol=1e-5)


def test_rotary_in_row_chunks_equals_whole_float32_rotary():
    torch.manual_seed(0)
    x = torch.randn(37, 2, 8, dtype=torch.bfloat16)  # 37 rows: chunks of 5 leave a short last one
    angles = torch.randn(37, 8)
    cos, sin = angles.cos(), angles.sin()
    whole = apply_rotary(x.float(), cos, sin).to(x.dtype)
    chunked = apply_rotary_float32(x, cos, sin, rows=5)
    assert chunked.dtype == x.dtype
    assert torch.equal(chunked, whole)


def test_placeholder_expansion():
    assert expand_image_tokens([1, START, IMAGE, END, 2, IMAGE], IMAGE, [3, 1]) == [1, START, IMAGE, IMAGE, IMAGE,
                                                                                   END, 2, IMAGE]
    assert expand_image_text(f"a{IMAGE_PAD}b{IMAGE_PAD}", [2, 1]) == f"a{IMAGE_PAD * 2}b{IMAGE_PAD}"
    with pytest.raises(InvalidInputError, match="2 image"):
        expand_image_tokens([IMAGE], IMAGE, [3, 1])


def test_bad_inputs(tiny_vl, tmp_path):
    path, _ = tiny_vl
    engine = Engine.load(path, device="cpu")
    inputs = preprocess_images([random_image(84, 112)], ImageConfig(max_pixels=MAX_PIXELS))
    ids = prompt_for(inputs)
    with pytest.raises(InvalidInputError, match="placeholder"):
        engine.logits([5, START, IMAGE, IMAGE, END], pixel_values=inputs.pixel_values,
                      image_grid_thw=inputs.image_grid_thw)  # 2 placeholders, the image needs 12
    with pytest.raises(InvalidInputError, match="patches"):
        engine.logits(ids, pixel_values=inputs.pixel_values[:-4], image_grid_thw=inputs.image_grid_thw)
    with pytest.raises(InvalidInputError, match="image_grid_thw"):
        engine.logits(ids, pixel_values=inputs.pixel_values)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    with pytest.raises(InvalidInputError, match="not an image"):
        load_image(broken)
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_image(tmp_path / "missing.jpg")


def test_config_with_top_level_text_fields_and_mrope_type():
    """Older config.json files (e.g. Qwen2.5-VL-7B's): text fields at the top, rope_scaling type "mrope"."""
    new = tiny_config().to_dict()
    new["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    old = {k: v for k, v in new.items() if k != "text_config"}
    old.update({k: v for k, v in new["text_config"].items()
                if k not in ("rope_parameters", "architectures", "model_type", "dtype")})
    old["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    old["rope_theta"] = 10000.0
    a, b = model_args(new), model_args(old)
    assert a.mrope_section == b.mrope_section == (2, 3, 3)
    assert a.rope == b.rope and a.hidden_size == b.hidden_size == 64 and a.vision == b.vision
    assert a.vision.fullatt_block_indexes == (1,) and a.attention_bias


def test_text_and_image_requests_share_scheduler_steps(tiny_vl):
    """A prompt with an image and a text-only prompt in one continuous batch (mixed rotary
    positions, image features replacing rows in a step that also holds another sequence's
    tokens, a small step size so the image prompt is read in chunks) give the greedy tokens
    transformers gives each alone."""
    from vramshard import vlm
    from vramshard.runtime.request import MultimodalInput

    path, model = tiny_vl
    engine = Engine.load(path, device="cpu")
    x = preprocess_images([random_image(140, 196, seed=7)], ImageConfig(max_pixels=MAX_PIXELS))
    ids_image = prompt_for(x)
    ids_text = [5, 17, 42, 3, 77, 12, 9]
    _, kw = hf_forward(model, ids_image, x)
    with torch.no_grad():  # each alone, by the reference implementation
        alone_image = model.generate(input_ids=torch.tensor([ids_image]), max_new_tokens=8, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, **kw)[0, len(ids_image):].tolist()
        alone_text = model.generate(torch.tensor([ids_text]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(ids_text):].tolist()

    pixels, grid = vlm.check_image_inputs(engine, x.pixel_values, x.image_grid_thw)
    features = vlm.encode_images(engine, pixels, grid)
    positions, delta = vlm.rope_index(ids_image, grid, engine.args)
    rows = torch.tensor([r for r, t in enumerate(ids_image) if t == IMAGE])
    scheduler = engine.scheduler(max_seqs=2, max_context=len(ids_image) + 8, max_step_tokens=16, chunk_sizes=(16,))
    text = scheduler.add(ids_text, max_new_tokens=8)
    image = scheduler.add(ids_image, max_new_tokens=8, multimodal=MultimodalInput(positions, delta, rows, features))
    mixed_steps = 0
    while scheduler.has_work:
        scheduler.step()
        mixed_steps += len(scheduler.running) == 2
    assert mixed_steps > 1 and len(ids_image) > 16  # the image prompt was read in chunks beside the text one
    assert image.output_ids == alone_image and text.output_ids == alone_text
