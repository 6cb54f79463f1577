"""Tiny random models and an offline tokenizer for hermetic tests (no download, deterministic).

* :func:`make_tokenizer` - a byte-level BPE tokenizer trained in code on :data:`CORPUS` (~400
  tokens, encodes any text). Specials: ``<pad>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos),
  ``<|im_start|>``=3, ``<|im_end|>``=4, and a ChatML-like ``chat_template``. ``add_bos=True`` gives
  the Llama-like variant: it prepends ``<s>`` to every encoding (a ``TemplateProcessing``
  post-processor) and, like Llama's own template, its chat template starts with ``bos_token`` (so
  rendering a chat to text and then encoding it *with* special tokens doubles the BOS, as on a real
  Llama). ``add_bos=False`` is the GPTNeoX/Pythia- and SmolLM2-like variant: no BOS anywhere.
* :func:`make_tiny_model` - ``"neox"`` (Pythia-shaped, partial rotary 0.25, no BOS) or ``"llama"``
  (grouped-query attention 4 query / 2 KV heads, tied embeddings, adds BOS). Weights are drawn
  with ``initializer_range`` = 0.3: with the default 0.02 attention is nearly uniform and a
  wrong ``position_ids`` barely moves the logits, so tests meant to catch position bugs could not
  fail (shifting 20 of 50 positions flips the argmax in 16/20 neox and 20/20 llama seeds at 0.3,
  0/20 at 0.02).
* :func:`save_tiny_model` - the same, saved with ``save_pretrained`` (model and tokenizer).
* :func:`write_tiny_gguf` - the llama model and its tokenizer written as an F32 GGUF file, to test
  kvstore's GGUF conversion without the 98 MB bundled file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, PreTrainedConfig, PreTrainedTokenizerFast

Kind = Literal["neox", "llama"]
KINDS: tuple[Kind, ...] = ("neox", "llama")

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)  # ids 0..4 in this order
VOCAB_TARGET = 400
MAX_POSITIONS = 512
INITIALIZER_RANGE = 0.3

CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "What is the capital of France? The capital of France is Paris. Paris is in France.",
    "Question: how many legs does a spider have? Answer: a spider has eight legs.",
    "Once upon a time there was a small model that stored its keys and values on disk,",
    "and every question about the same context was answered from the stored cache.",
    "def add(x, y):\n    return x + y\n\nprint(add(2, 3))\n",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 -1 +2 x*y (a) [b] {c} <d> 'e' \"f\" #g @h",
    "user: hello there!\nassistant: Hi! How can I help you today?\n",
)

# ChatML, written with string concatenation so that whitespace control cannot eat the newlines.
_CHAT_BODY = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_TEMPLATE = _CHAT_BODY
CHAT_TEMPLATE_WITH_BOS = "{{ bos_token }}" + _CHAT_BODY


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """The trained ``tokenizers`` model as JSON (training is deterministic; done once per process)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def make_tokenizer(add_bos: bool = False) -> PreTrainedTokenizerFast:
    """A fresh offline tokenizer; ``add_bos`` picks the Llama-like variant (see module docstring)."""
    tok = Tokenizer.from_str(_trained_tokenizer_json())
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE_WITH_BOS if add_bos else CHAT_TEMPLATE,
    )


def tiny_config(kind: Kind, vocab_size: int, attn_implementation: str = "sdpa") -> PreTrainedConfig:
    """The config of a tiny model of ``kind`` (hidden 64, 4 heads, 2 layers, 512 positions)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INITIALIZER_RANGE,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
    )
    if kind == "neox":
        config = GPTNeoXConfig(**common, rotary_pct=0.25, tie_word_embeddings=False)
    elif kind == "llama":
        config = LlamaConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use one of {KINDS}")
    config._attn_implementation = attn_implementation
    return config


def make_tiny_model(
    kind: Kind, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation: str = "sdpa"
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """``(model, tokenizer)``: a tiny random causal LM in eval mode with gradients off.

    The weights depend only on ``kind`` and ``seed``: they are drawn in float32 (without touching
    the global RNG) and then cast, so the float64 model of a seed is the float32 one, widened.
    """
    tokenizer = make_tokenizer(add_bos=kind == "llama")
    config = tiny_config(kind, len(tokenizer), attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def save_tiny_model(directory: str | Path, kind: Kind, seed: int = 0) -> Path:
    """Save a tiny model and its tokenizer with ``save_pretrained`` into ``directory``; return it."""
    directory = Path(directory)
    model, tokenizer = make_tiny_model(kind, seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_tiny_gguf(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny llama model (weights as F32) and a no-BOS tokenizer as a GGUF file.

    Q and K projections are permuted the way llama.cpp's converter does; transformers undoes it on
    load, so the GGUF loads back to the same model.
    """
    import gguf

    path = Path(path)
    model, _ = make_tiny_model("llama", seed=seed)
    config = model.config
    vocab = json.loads(_trained_tokenizer_json())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])  # 3 = control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(SPECIAL_TOKENS.index(BOS))
    writer.add_eos_token_id(SPECIAL_TOKENS.index(EOS))
    writer.add_pad_token_id(SPECIAL_TOKENS.index(PAD))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":  # tied: llama.cpp writes no output tensor then
            continue
        array = tensor.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, heads)
        elif hf_name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, kv_heads)
        base = hf_name.removesuffix(".weight")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        writer.add_tensor(gguf_name + ".weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_permute(weight, n_head: int):  # numpy in, numpy out
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# -- other cache families ------------------------------------------------------------------------
def _family_configs(vocab: int) -> dict[str, PreTrainedConfig]:
    """Tiny configs of the families kvstore classifies (kvstore.model.family.families), by name."""
    import transformers as T

    attn = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    pos = dict(max_position_embeddings=MAX_POSITIONS)
    mamba = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
    return {
        # sliding / chunked windows (8 tokens, so test contexts are longer than the window)
        "mistral": T.MistralConfig(**attn, **pos, num_hidden_layers=2, sliding_window=8, head_dim=16),
        "gemma3": T.Gemma3TextConfig(
            **attn, **pos, num_hidden_layers=4, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        ),
        "qwen2-sliding": T.Qwen2Config(
            **attn, **pos, num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1
        ),
        "mixtral": T.MixtralConfig(
            **attn, **pos, num_hidden_layers=2, sliding_window=8, head_dim=16, num_local_experts=2,
            num_experts_per_tok=1,
        ),
        "qwen3-sliding": T.Qwen3Config(
            **attn, **pos, num_hidden_layers=3, head_dim=16, use_sliding_window=True, sliding_window=8,
            max_window_layers=1,
        ),
        "starcoder2": T.Starcoder2Config(**attn, **pos, num_hidden_layers=2, sliding_window=8),
        "cohere2": T.Cohere2Config(
            **attn, **pos, num_hidden_layers=4, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        ),
        "gemma2": T.Gemma2Config(
            **attn, **pos, num_hidden_layers=4, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        "gpt-oss": T.GptOssConfig(  # learned attention sinks (per-head logits), sliding + full layers
            **{**attn, "intermediate_size": 64}, **pos, head_dim=16, num_hidden_layers=2, sliding_window=8,
            num_local_experts=2, num_experts_per_tok=1,
        ),
        "llama4-chunked": T.Llama4TextConfig(
            **attn, **pos, intermediate_size_mlp=128, head_dim=16, num_hidden_layers=4, attention_chunk_size=8,
            num_local_experts=2, attn_temperature_tuning=False,
        ),
        # state-space and hybrids
        "mamba2": T.Mamba2Config(
            vocab_size=vocab, hidden_size=32, state_size=8, num_heads=4, head_dim=16, expand=2, n_groups=1,
            num_hidden_layers=2, conv_kernel=4, chunk_size=8,
        ),
        "bamba": T.BambaConfig(
            **attn, **pos, **mamba, num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=4,
            mamba_d_head=32, mamba_n_groups=1, mamba_chunk_size=8,
        ),
        "lfm2": T.Lfm2Config(**attn, **pos, num_hidden_layers=4, full_attn_idxs=[1, 3], conv_L_cache=3),
        "mamba": T.MambaConfig(
            vocab_size=vocab, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
        ),
        "jamba": T.JambaConfig(
            **attn, **pos, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, num_experts=2,
            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            use_mamba_kernels=False,
        ),
        "falcon_h1": T.FalconH1Config(
            **attn, **pos, num_hidden_layers=2, head_dim=16, mamba_n_heads=4, mamba_d_ssm=128, mamba_d_head=32,
            mamba_expand=2, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=8,
        ),
        "qwen3_next": T.Qwen3NextConfig(
            **attn, **pos, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=2,
            num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        ),
        "zamba2": T.Zamba2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
            **pos, num_hidden_layers=4, attention_head_dim=32, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_headdim=16, n_mamba_heads=8, chunk_size=8, num_mem_blocks=1, use_mem_rope=True,
            layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
        ),
        # position features
        "mpt": T.MptConfig(vocab_size=vocab, d_model=64, n_heads=4, n_layers=2, max_seq_len=MAX_POSITIONS),
        "llama-dynamic-rope": T.LlamaConfig(
            **attn, num_hidden_layers=2, max_position_embeddings=16,
            rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        ),
        # accepted: ALiBi computed from the 2-D mask, learned absolute positions
        "bloom": T.BloomConfig(vocab_size=vocab, hidden_size=64, n_head=4, n_layer=2),
        "gpt2": T.GPT2Config(
            vocab_size=vocab, n_embd=64, n_head=4, n_layer=2, n_positions=MAX_POSITIONS, bos_token_id=1, eos_token_id=2
        ),
    }  # fmt: skip


FAMILIES: tuple[str, ...] = tuple(_family_configs(8))


def make_family_model(
    name: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation: str | None = "sdpa"
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """``(model, tokenizer)`` of family ``name`` (see :data:`FAMILIES`): untied embeddings (a tied
    tiny model mostly echoes its input, hiding window bugs), ``initializer_range`` 0.3, the no-BOS
    tokenizer. ``attn_implementation=None`` keeps the architecture's default."""
    tokenizer = make_tokenizer(add_bos=False)
    config = _family_configs(len(tokenizer))[name]
    config.initializer_range = INITIALIZER_RANGE
    config.tie_word_embeddings = False
    config.pad_token_id = SPECIAL_TOKENS.index(PAD)
    config.eos_token_id = SPECIAL_TOKENS.index(EOS)
    config.bos_token_id = SPECIAL_TOKENS.index(BOS)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    config._experts_implementation = "eager"  # MoE kernels refuse float64 on CPU
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(dtype).eval().requires_grad_(False)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def save_family_model(directory: str | Path, name: str, seed: int = 0) -> Path:
    """A family model and its tokenizer saved with ``save_pretrained`` into ``directory``."""
    directory = Path(directory)
    model, tokenizer = make_family_model(name, seed=seed, attn_implementation=None)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
