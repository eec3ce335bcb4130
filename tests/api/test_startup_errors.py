"""`pagedmodel serve --model DIR` on a model it cannot load: one clear line on stderr, no traceback, exit != 0.

That one line is also what a crash-looping engine pod reports (the operator's engine container uses
terminationMessagePolicy FallbackToLogsOnError, so its termination message is the log's tail, and
`kubectl describe pm` shows its last line), so it must be the last thing printed and fit on a line.
The model directories here are hand-made and tiny: nothing needs the real model or a tokenizer download.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 128}
# root reads any directory whatever its mode; without these capabilities its permissions apply to root too
NO_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


def serve(model_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: a mode-000 directory stays readable to root")
        prefix = NO_DAC
    return subprocess.run([*prefix, sys.executable, "-m", "pagedmodel.cli", "serve", "--model", str(model_dir),
                           "--device", "cpu", "--port", "0", *extra], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def model_dir(path: Path, **config: object) -> Path:
    """A directory with config.json and one small, well-formed safetensors file, plus a word-level tokenizer."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, **config}))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, str(path / "model.safetensors"))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "t1"}))
    return path


def one_error_line(r: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    # the error is one line, and the last: a pod's termination message is the log's tail; what comes before
    # it is the start's progress (INFO lines), never a second error or a warning
    assert lines and lines[-1].startswith("pagedmodel serve: error: "), lines
    assert all(" INFO " in line for line in lines[:-1]), lines
    return lines[-1]


def test_an_unreadable_model_directory_says_so(tmp_path: Path) -> None:
    """Guards: a directory this process may not read is named as unreadable (not as 'has no config.json',
    which is what a failed stat of config.json inside it looks like), exit 2."""
    d = model_dir(tmp_path / "locked")
    d.chmod(0)
    try:
        line = one_error_line(serve(d))
    finally:
        d.chmod(0o755)
    assert f"model directory {d} is not readable by this process" in line


@pytest.mark.parametrize("damage, said", [
    ("truncate", "is truncated or corrupt: its header describes 4096 bytes of tensor data, the file holds 2"),
    ("garbage", "is not a valid safetensors file"),
])
def test_a_corrupt_safetensors_file_is_named_before_anything_loads(tmp_path: Path, damage: str, said: str) -> None:
    """Guards: a truncated download or a file that is not safetensors fails at startup with
    the file's path and what is wrong with it, exit 2 (not a safetensors traceback from the weight loader)."""
    d = model_dir(tmp_path / "model")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(b"<html>404 Not Found</html>")       # what a failed download leaves behind
    line = one_error_line(serve(d))
    assert str(weights) in line and said in line and "download it again" in line


def test_an_unknown_architecture_is_refused_with_the_supported_ones(tmp_path: Path) -> None:
    """Guards: config.json naming an architecture the engine has no model for fails with its name and the
    supported list, exit 2."""
    d = model_dir(tmp_path / "mamba", architectures=["MambaForCausalLM"], model_type="mamba")
    line = one_error_line(serve(d))
    assert "has architecture MambaForCausalLM, which is not supported; supported: LlamaForCausalLM" in line


def test_well_formed_weights_that_do_not_fit_the_model_fail_in_one_line(tmp_path: Path) -> None:
    """Guards: a readable checkpoint whose tensors do not match its config (the loader's check) still ends in
    one line, exit 2."""
    line = one_error_line(serve(model_dir(tmp_path / "partial")))
    assert "cannot load the model: checkpoint lacks 8 tensors" in line


def test_any_other_startup_failure_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    """Guards: a failure nobody anticipated (here transformers refusing an odd head size in config.json) is
    still one line with the exception's type, exit 1; --log-level debug adds the traceback for whoever digs."""
    d = model_dir(tmp_path / "odd", hidden_size=15, num_attention_heads=3, num_key_value_heads=1)
    line = one_error_line(serve(d), code=1)
    assert line.startswith("pagedmodel serve: error: cannot start the engine: ") and "head_dim" in line
    debug = serve(d, "--log-level", "debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == line      # the one line is still the last one
