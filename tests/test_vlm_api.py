"""The high-level VLM API (chat with PIL images / files), `vramshard run --image`, the vision VRAM switches."""

import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from vramshard import vlm
from vramshard.cli.main import main
from vramshard.demo_model import CHATML_TEMPLATE, SPLIT_PATTERN
from vramshard.errors import BudgetError
from vramshard.loading.image import IMAGE_PLACEHOLDER, ImageConfig, expand_image_tokens, preprocess_images
from vramshard.plan.memory import VramNeed, vision_workspace_bytes

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
START, IMAGE, END = 3, 4, 5  # trainer special tokens come first, in order
VOCAB = 400
MAX_PIXELS = 28 * 28 * 64
TRAIN = ["A picture of a cat on a mat.\n", "What is in the image? Describe it.\n", "The quick brown fox.\n"] * 20


def train_tokenizer():
    """A byte-level BPE tokenizer (as vramshard.demo_model makes) with the Qwen2-VL vision tokens."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=VOCAB, min_frequency=1, show_progress=False, special_tokens=list(SPECIALS),
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAIN, trainer=trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIALS[3:]] == [START, IMAGE, END]
    return tokenizer


def make_tiny_vl(path, seed=0):
    """A tiny random Qwen2.5-VL (transformers, float32) with tokenizer files, saved under ``path``."""
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, initializer_range=0.1,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1], initializer_range=0.1),
        image_token_id=IMAGE, video_token_id=VOCAB - 1, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    tokenizer = train_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIALS)}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 56 * 56, "max_pixels": MAX_PIXELS}))
    return path


def random_image(height, width, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_vl(tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return vlm.load(model_dir, device="cpu")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    pictures = [random_image(140, 196, seed=1), random_image(84, 112, seed=2)]
    files = [folder / "a.png", folder / "b.jpg"]
    pictures[0].save(files[0])
    pictures[1].save(files[1], quality=95)
    return pictures, files


def tensor_prompt(engine, text, sources):
    """What a user of the tensor API builds by hand: template, placeholders, preprocessing, expansion."""
    content = IMAGE_PLACEHOLDER * len(sources) + text
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": content}])
    inputs = preprocess_images(sources, ImageConfig(max_pixels=MAX_PIXELS))
    return expand_image_tokens(ids, IMAGE, inputs.tokens_per_image(2)), inputs


def test_high_level_api_equals_tensor_api(engine, images):
    pictures, files = images
    ids, inputs = tensor_prompt(engine, "What is in the image?", files)
    expected = engine.generate([ids], 12, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw)[0]
    prompt = vlm.chat_prompt(engine, "What is in the image?", files)
    assert prompt.ids == ids
    assert torch.equal(prompt.pixel_values, inputs.pixel_values)
    assert vlm.generate_chat(engine, "What is in the image?", files, max_new_tokens=12) == expected
    assert list(vlm.stream_chat(engine, "What is in the image?", files, max_new_tokens=12)) == expected
    # Messages with image parts carrying the images; PIL images of the PNG file give the same (lossless).
    messages = [{"role": "user", "content": [{"type": "image", "image": pictures[0]}, {"type": "image"},
                                             {"type": "text", "text": "What is in the image?"}]}]
    assert vlm.chat_prompt(engine, messages, [files[1]]).ids == ids
    # The images matter: another picture changes the answer's logits.
    other = vlm.chat_prompt(engine, "What is in the image?", [random_image(140, 196, seed=9), files[1]])
    assert not torch.allclose(engine.logits(other.ids, other.pixel_values, other.image_grid_thw),
                              engine.logits(ids, inputs.pixel_values, inputs.image_grid_thw), atol=1e-3)


def test_image_count_must_match_parts(engine, images):
    from vramshard.errors import InvalidInputError

    _, files = images
    with pytest.raises(InvalidInputError, match="no image part"):
        vlm.chat_prompt(engine, [{"role": "user", "content": "hi"}], files)
    with pytest.raises(InvalidInputError, match="more image parts"):
        vlm.chat_prompt(engine, [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], files[:1])


def test_cli_run_with_images(capsys, model_dir, engine, images):
    _, files = images
    expected = engine.tokenizer.decode(vlm.generate_chat(engine, "Describe it.", files, max_new_tokens=10))
    code = main(["run", str(model_dir), "--image", str(files[0]), "--image", str(files[1]), "-p", "Describe it.",
                 "-n", "10", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == expected + ("" if expected.endswith("\n") else "\n")
    assert "vision encoder" in err
    code = main(["run", str(model_dir), "--image", str(files[0].parent / "missing.png"), "-p", "x", "--device", "cpu"])
    assert code != 0 and "does not exist" in capsys.readouterr().err


SWITCHES = {"offload_weights": False, "memory_efficient_attention": False, "free_before_prefill": False}


@pytest.mark.parametrize("switch", list(SWITCHES) + ["all"])
def test_each_switch_gives_identical_logits_on_cpu(model_dir, images, switch):
    _, files = images
    reference = vlm.load(model_dir, device="cpu")
    prompt = vlm.chat_prompt(reference, "Describe it.", files)
    expected = reference.logits(prompt.ids, prompt.pixel_values, prompt.image_grid_thw)
    options = vlm.VisionOptions.all_off() if switch == "all" else vlm.VisionOptions(**{switch: SWITCHES[switch]})
    # Small MLP row chunks, so the chunked path runs too (on when memory-efficient attention is).
    switched = vlm.load(model_dir, device="cpu", vision=vlm.VisionOptions(**{**options.__dict__, "mlp_rows": 8}))
    assert vlm.vision_setup(switched).options.mlp_rows == 8
    got = switched.logits(prompt.ids, prompt.pixel_values, prompt.image_grid_thw)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert vlm.generate_chat(switched, "Describe it.", files, max_new_tokens=6) == \
        vlm.generate_chat(reference, "Describe it.", files, max_new_tokens=6)


def test_too_large_image_error_says_need_and_what_fits(engine):
    model = engine.model
    need = VramNeed(resident=100 * 2**20, slots=0, kv=50 * 2**20, workspace=80 * 2**20)
    options = vlm.VisionOptions()
    budget = need.resident + vision_workspace_bytes(model, 4000)
    vlm.check_fits(model, need, budget, 4000, options)  # fits: no error
    with pytest.raises(BudgetError) as caught:
        vlm.check_fits(model, need, budget, 200_000, options)
    text = str(caught.value)
    assert "vision phase" in text and "at most" in text and "pixels" in text
    most = int(text.split("at most ")[1].split(" pixels")[0].replace(",", ""))
    assert 3000 * 196 <= most < 200_000 * 196
    # Overlapping phases and naive attention need more: with them off, 4000 patches no longer fit.
    with pytest.raises(BudgetError, match="memory-efficient attention and free-before-prefill options on"):
        vlm.check_fits(model, need, budget, 4000, vlm.VisionOptions.all_off())


def test_a_budget_that_holds_no_image_says_so(engine):
    """When not even one merged patch fits beside the language model, the error says no image fits
    and what the image needs, instead of "at most 0 pixels"."""
    model = engine.model
    need = VramNeed(resident=100 * 2**20, slots=0, kv=50 * 2**20, workspace=80 * 2**20)
    overlapping = vlm.VisionOptions(free_before_prefill=False)  # the phases add up: KV + workspace too
    budget = need.resident + need.kv  # less than the language model's step needs beside the vision phase
    with pytest.raises(BudgetError) as caught:
        vlm.check_fits(model, need, budget, 4000, overlapping)
    text = str(caught.value)
    assert "no image fits" in text and "0 pixels" not in text
    assert "raise --vram to at least" in text and "free-before-prefill options on" in text


def test_vision_workspace_grows_with_patches_and_naive_attention():
    from vramshard.shapes import shape_model

    model = shape_model("qwen2.5-vl-7b")  # no weights: only the shapes
    small, large = vision_workspace_bytes(model, 2040), vision_workspace_bytes(model, 18564)  # 480p, 1440p
    assert small < large < 2**30  # 1440p's activations stay under 1 GiB with the optimizations
    naive = vision_workspace_bytes(model, 18564, memory_efficient=False)
    assert naive > 2 * 16 * 18564**2 * 4  # the full-attention scores of 16 heads, and their softmax


# ---------------------------------------------------------------------- GPU (run on the GPU machine)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_gpu_switches_match_cpu(model_dir, images, switch):
    _, files = images
    cpu = vlm.load(model_dir, device="cpu")
    prompt = vlm.chat_prompt(cpu, "Describe it.", files)
    expected = cpu.logits(prompt.ids, prompt.pixel_values, prompt.image_grid_thw)
    for options in (vlm.VisionOptions(), vlm.VisionOptions(**{switch: SWITCHES[switch]})):
        engine = vlm.load(model_dir, device="cuda", vram="1GiB", vision=options, max_step_tokens=256,
                          max_context=1024)
        assert engine.executor.plans.tiers[-1] == vlm.VISION_TIER
        got = engine.logits(prompt.ids, prompt.pixel_values, prompt.image_grid_thw)
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
        del engine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_too_large_image_is_refused(model_dir):
    engine = vlm.load(model_dir, device="cuda", vram="256MiB", max_step_tokens=256, max_context=1024,
                      image_config=ImageConfig(max_pixels=10**8))
    big = random_image(3000, 3000)  # ~46k patches: more activations than the budget holds
    with pytest.raises(BudgetError, match="at most"):
        vlm.generate_chat(engine, "Describe it.", [big], max_new_tokens=2)


def shrink_while_streaming(engine, files) -> tuple[list[int], int]:
    """Stream an image chat; after 3 tokens, a budget that fits only half the resident weights.
    Returns (the tokens, that budget)."""
    need = engine.executor.need
    smaller = need.total - need.resident // 2
    tokens = []
    for token in vlm.stream_chat(engine, "Describe it.", files, max_new_tokens=10):
        tokens.append(token)
        if len(tokens) == 3:
            engine.set_vram(smaller)
    return tokens, smaller


def test_a_budget_change_re_places_a_vision_language_model(model_dir, images):
    """A VLM follows a changed VRAM budget like a text model (simulated GPU): the language model is
    re-planned with room for the vision phase, the vision tier stays, the answer is unchanged."""
    from vramshard.profile.query import synthetic

    profile = synthetic(cpu_gflops=50, gpu_gflops=20_000, h2d_gbps=25, cpu_threads=2)
    _, files = images
    expected = vlm.generate_chat(vlm.load(model_dir, device="cpu"), "Describe it.", files, max_new_tokens=10)
    engine = vlm.load(model_dir, vram="1GiB", simulate_gpu=True, profile=profile, max_step_tokens=256,
                      max_context=1024)
    assert engine.executor.oom_handler == engine.budget.recover_from_oom  # kept through vlm.configure
    roomy = engine.executor.need
    tokens, smaller = shrink_while_streaming(engine, files)
    assert tokens == expected
    assert engine.budget_events and engine.budget_events[-1]["budget"] == smaller
    assert engine.executor.budget == smaller and engine.executor.need.total <= smaller
    assert engine.executor.need.resident < roomy.resident
    assert engine.executor.plans.tiers[-1] == vlm.VISION_TIER
    # A second image chat runs its vision phase under the new placement.
    again = vlm.generate_chat(engine, "Describe it.", files, max_new_tokens=10)
    assert again == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_budget_change_releases_vram_of_a_vision_language_model(model_dir, images):
    _, files = images
    engine = vlm.load(model_dir, device="cuda", vram="1GiB", max_step_tokens=256, max_context=1024)
    expected = vlm.generate_chat(engine, "Describe it.", files, max_new_tokens=10)
    roomy = engine.executor.need
    tokens, smaller = shrink_while_streaming(engine, files)
    assert tokens == expected
    assert engine.executor.need.total <= smaller and engine.executor.need.resident < roomy.resident
    # What this executor holds, not what earlier tests left in the process's allocator.
    assert engine.budget_events[-1]["reserved_after"] - engine.executor._vram_before <= smaller + 64 * 2**20
    assert vlm.generate_chat(engine, "Describe it.", files, max_new_tokens=10) == expected


def test_options_that_do_not_fit_are_refused_and_the_engine_keeps_its_placement(model_dir, images):
    """Vision options whose placement does not fit the budget raise BudgetError; the engine keeps
    the placement, plan and options it had and still answers."""
    from vramshard.profile.query import synthetic

    profile = synthetic(cpu_gflops=50, gpu_gflops=20_000, h2d_gbps=25, cpu_threads=2)
    _, files = images
    engine = vlm.load(model_dir, vram="1GiB", simulate_gpu=True, profile=profile, max_step_tokens=256,
                      max_context=1024)
    expected = vlm.generate_chat(engine, "Describe it.", files, max_new_tokens=6)
    need = engine.executor.need.total
    engine.set_vram(need)  # just what the offloaded vision phase needs
    engine.poll_budget()
    placed = (engine.executor.plans, engine.plan, engine.vision)
    # Resident vision weights, naive attention and overlapping phases: more than this budget holds
    # however the language model is placed.
    with pytest.raises(BudgetError):
        vlm.configure(engine, vlm.VisionOptions.all_off(), profile=profile)
    assert (engine.executor.plans, engine.plan, engine.vision) == placed
    assert vlm.generate_chat(engine, "Describe it.", files, max_new_tokens=6) == expected
