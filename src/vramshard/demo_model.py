"""The built-in demo model: a small Qwen3 with random weights and a small trained tokenizer.

``vramshard demo`` needs a model without downloads. On first use :func:`ensure_demo_model`
builds one into the user cache directory: a real architecture (Qwen3, Hugging Face tensor
names, bfloat16 safetensors) at toy size, random weights from a fixed seed, and a byte-level
BPE tokenizer trained on the English text below, with a ChatML chat template. Hugging Face
transformers loads the result as is. The weights are random, so the text it writes is gibberish;
the speed it runs at is real.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .errors import ModelLoadError
from .paths import cache_dir as default_cache_dir

log = logging.getLogger(__name__)

DEMO_VERSION = 1  # bump when anything below changes: a new version builds into a new directory
SEED = 20261129
TOKENIZER_VOCAB = 2000
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2/Qwen3's pre-tokenizer split (as their tokenizer.json writes it).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MODEL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "use_sliding_window": False,
    "sliding_window": None,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

# Training text for the tokenizer: plain English about what vramshard does.
TRAINING_TEXT = """\
vramshard runs language models whose weights do not fit in the memory of the graphics card.
A desktop or a laptop often has a GPU with a few gigabytes of free memory, a processor with eight
or sixteen cores, and a PCIe link between them. A model with eight billion parameters stored in
half precision needs sixteen gigabytes for its weights alone, and a mixture of experts model needs
far more. The usual answer is to put some layers on the GPU and the rest on the CPU, and to let the
user guess how many layers fit. vramshard makes that decision by itself, and it makes it again for
every step, because the best place for a piece of the model depends on how much work the step has.

The model is cut into sub-layers. There is the embedding, then for every transformer block an
attention sub-layer and a feed forward sub-layer, and at the end the head that turns the last hidden
state into logits over the vocabulary. Each sub-layer knows its weights, their shapes, their type and
their size in bytes. It also knows what it costs: how many floating point operations it needs for a
number of new tokens at a given context length, and how many bytes it has to read.

First the machine is measured. Small benchmarks time matrix multiplication on the CPU and on the GPU
for many shapes, copies from pinned host memory to the device and back, attention at many context
lengths, and the fixed cost of starting one sub-layer from Python. The CPU is measured twice, once
alone and once while the copy engine is busy, because both share the memory controller. The results
are stored in a small file in the cache directory, keyed by a fingerprint of the machine, and they
are reused the next time.

Then a plan is made. Under the memory budget the planner chooses which sub-layers keep their weights
in video memory for the whole run. For every token tier, that is for one token, four tokens, sixteen
tokens and so on up to a few thousand tokens of a long prompt, it decides where every other sub-layer
runs. In a GPU only plan every sub-layer runs on the GPU, and the weights that are not kept there are
streamed over PCIe into a ring of slots while the GPU computes the previous sub-layer. This wins when
there are many tokens, because the computation hides the transfer. In a static plan the attention and
its cache stay on the GPU and the feed forward layers run on the CPU from host memory. There is no
traffic over the bus, and this wins when the processor is strong and the step has few tokens. A
dynamic plan mixes the two: some sub-layers stream to the GPU while the CPU computes others, so the
transfer and the computation overlap.

An estimator predicts how long a step takes for each plan. It simulates three resources, the CPU, the
GPU and the copy engine, and it feeds them with the numbers from the profile. The fastest plan that
fits the budget wins its tier. The plans can be printed as a table, written as JSON, or drawn as a
picture that shows which sub-layer runs where for every tier.

When the model runs, each forward step counts its new tokens, picks the smallest tier that covers
them and runs the plan of that tier. A chat produces one token per step, so it uses the plan for one
token. Reading a long prompt uses the plan for many tokens. A server with many users mixes the tokens
of all running requests into one step and switches plans as the mix changes.

The weights live in pinned host memory, read from safetensors files or from a GGUF file. The video
memory holds the weights that are kept there, a ring of slots for streamed weights, the key and value
cache, and the activations of the largest tier. The budget covers all of it, and the peak is measured,
not assumed. One stream computes and another copies, and events make sure that a slot is full before
it is used and free before it is filled again. Activations cross the bus only where two sub-layers in
a row run on different devices. Without any GPU the same engine simply plans everything onto the CPU.

Mixture of experts models get special care. Only the experts that a step routes its tokens to are
streamed, and a cache in video memory keeps the experts that are used most often. The budget may
change while the engine runs, for example when a game takes memory back, and the engine makes a new
plan at the next step without losing any request. The estimator also corrects itself from the step
times it measures.

To try it, install the package and run the demo. The demo builds a small model of a real
architecture with random weights and a small tokenizer trained on this very text. Because the
weights are random, the model writes nonsense, but it writes it at real speed, and every part of
the engine is used: loading, planning, the cache, sampling and streaming text to the terminal.
Then point it at a real model directory with config.json and safetensors files, or at a GGUF file,
give it a budget such as four gigabytes, and ask it a question. The answer streams as it is
generated, and at the end it reports how many tokens per second it read and wrote.

Good engineering keeps three things apart. The model files say what to compute and never move a
tensor to a device. The plan is plain data that says where each weight lives and where each
sub-layer computes; it can be printed, saved and tested without a GPU. The executor is the only
part that owns streams, events, slots and pinned buffers, and it runs one loop over the plan while
it prefetches the next streamed weight. Numbers are checked against a reference that runs all of
the model on the CPU in full precision, and every plan must compute the same function within the
tolerance of its data type.

How text becomes numbers: a tokenizer splits the prompt into pieces and maps each piece to an
integer. Byte pair encoding starts from single bytes and learns merges of frequent neighbours, so
common words become one token while rare words, names, emoji and characters from other scripts are
spelled out from smaller pieces. Decoding runs the other way. When text streams to the terminal, a
token may end in the middle of a character, and the streaming decoder waits until the character is
complete before printing it. Stop strings are handled the same careful way: text that could be the
beginning of a stop string is held back until the next token shows whether it really is one.

Chat models expect a conversation in a particular format. The chat template, written in Jinja, turns
a list of messages with roles such as system, user and assistant into the exact text the model saw
during training, with markers that open and close every turn. The interactive chat keeps the history,
renders it with the template, and streams the answer; pressing control and C stops the answer but not
the program, and the next question continues the conversation.

Sampling chooses the next token from the logits. Greedy decoding takes the most likely token and is
deterministic. Temperature flattens or sharpens the distribution; top k keeps only the k likeliest
tokens; top p keeps the smallest set whose probabilities add up to p. A seed makes sampled output
reproducible. Generation ends at an end of sequence token, at a stop string, or after the maximum
number of new tokens.

The key and value cache remembers, for every layer, the projections of all earlier tokens, so that a
new token attends to the past without recomputing it. Its size grows with the context length, the
number of layers, the number of key value heads and the head dimension. Grouped query attention
shares each key value head among several query heads and shrinks the cache. The cache has a fixed
home for every layer, decided once, so that no step has to shuffle it between devices.

A benchmark reports prompt processing speed, generation speed, the time to the first token, the
latency from request to answer, and the throughput of batches of one, four, sixteen and sixty-four
sequences. It compares the planned engine with simple baselines in the same run: everything on the
processor, whole layers on the graphics card up to the budget, and an unconstrained run, together with
the physical bound. That bound is simple: every byte of weights that is not kept in video memory must
either cross the bus or be read by the processor, so one decoding step can never be faster than those
bytes divided by the sum of both bandwidths. Reports include peak memory, checked with the allocator,
and the predicted against the measured step time, which shows how well the estimator understands the
hardware.

Vocabulary for curious readers: accelerator, allocator, bandwidth, bottleneck, checkpoint, compiler,
concurrency, contention, deterministic, embedding, fingerprint, gradient, heuristic, inference,
interpolation, kernel, latency, matrix, microbenchmark, normalization, optimizer, parameter, pipeline,
precision, projection, quantization, residual, rotary, scheduler, throughput, transformer, vector,
warmup, workspace. Weekdays: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Months:
January, February, March, April, May, June, July, August, September, October, November, December.
Colours: red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown, purple, pink.

A short story about why this matters. Maria studies biology and wants to summarize hundreds of
papers on her old laptop. Its graphics chip has four gigabytes, far too little for a capable model,
and renting a server costs money she would rather spend on reagents. Tomasz builds a game and wants
a friendly character that answers players, but the game itself occupies most of the video memory.
Aiko writes software for a hospital where no data may leave the building. Each of them owns a machine
that is quite fast when every component works together: the processor multiplies matrices from main
memory, the graphics card crunches whatever arrives in time, and the bus keeps delivering weights.
Orchestrating that cooperation automatically, instead of forcing people to tune mysterious flags,
is the whole purpose of this project. Honest measurement keeps everyone grounded: published numbers
come from reproducible commands, baselines run beside the candidate, and surprising results are
investigated rather than celebrated.

Questions people ask: Does it need the internet? No, nothing is downloaded while it runs. Does it
change the model? No, the weights keep their precision, bfloat16 or float16, and nothing is
quantized. How much memory does it need? As much as you give it, and it tells you if the budget is
too small and by how much. Which models work? Llama, Mistral, Qwen and their mixtures of experts,
from Hugging Face directories or GGUF files with float weights. Numbers 0 1 2 3 4 5 6 7 8 9 10 16
32 64 128 256 512 1024 2048 4096, and symbols such as + - * / = < > ( ) [ ] { } : ; , . ! ? " ' # %.
"""


def ensure_demo_model(cache_dir: str | Path | None = None,
                      status: Callable[[str], None] | None = None) -> Path:
    """Directory of the demo model, built on first use; ``cache_dir`` defaults to the user cache.

    The build happens in a temporary directory that is renamed into place when complete, so an
    interrupted build leaves nothing half-made. ``status`` receives a short line per build stage.
    """
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = parent / f"demo-{DEMO_VERSION}"
    if (target / "config.json").is_file():
        return target
    say = status or (lambda line: None)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".demo-{DEMO_VERSION}-", dir=parent))
    except OSError as exc:
        raise ModelLoadError(f"cannot write the demo model into {str(parent)!r} ({exc}); "
                             "set VRAMSHARD_CACHE to a writable directory") from None
    try:
        say("training the demo tokenizer")
        tokenizer = train_tokenizer()
        write_tokenizer_files(tokenizer, staging)
        say("writing random Qwen3 weights")
        config = dict(MODEL_CONFIG, vocab_size=tokenizer.get_vocab_size(),
                      bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
                      eos_token_id=tokenizer.token_to_id("<|im_end|>"))
        write_weights(config, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise ModelLoadError(f"{str(target)!r} exists but holds no complete demo model; "
                                     "delete it and run again") from None
            shutil.rmtree(staging, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("built the demo model in %s", target)
    return target


def train_tokenizer():
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on :data:`TRAINING_TEXT` (Qwen2 style)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=TOKENIZER_VOCAB, min_frequency=1, show_progress=False,
                         special_tokens=list(SPECIAL_TOKENS),
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def write_tokenizer_files(tokenizer, directory: Path) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML template) and generation_config.json."""
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(token)): {"content": token, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": True}
        for token in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "eos_token_id": [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")],
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "do_sample": False,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def random_weights(config: dict) -> dict[str, torch.Tensor]:
    """Qwen3 tensors under their Hugging Face names: normal(0, 0.02) matrices, norms of ones, bf16."""
    generator = torch.Generator().manual_seed(SEED)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) * 0.02).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": matrix(config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "self_attn.q_proj.weight": matrix(q_out, hidden),
            p + "self_attn.k_proj.weight": matrix(kv_out, hidden),
            p + "self_attn.v_proj.weight": matrix(kv_out, hidden),
            p + "self_attn.o_proj.weight": matrix(hidden, q_out),
            p + "self_attn.q_norm.weight": ones(head_dim),
            p + "self_attn.k_norm.weight": ones(head_dim),
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
            p + "mlp.gate_proj.weight": matrix(inter, hidden),
            p + "mlp.up_proj.weight": matrix(inter, hidden),
            p + "mlp.down_proj.weight": matrix(hidden, inter),
        })
    tensors["model.norm.weight"] = ones(hidden)
    return tensors


def write_weights(config: dict, directory: Path) -> None:
    from safetensors.torch import save_file

    save_file(random_weights(config), str(directory / "model.safetensors"), metadata={"format": "pt"})
