"""The `pdrt` command line, run as a user runs it."""

import subprocess
import sys


def run_pdrt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdrt.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_an_answer_from_a_local_checkpoint(model_dirs, tokenizer):
    proc = run_pdrt("generate", "def main():", "--model", str(model_dirs["llama"]), "--max-tokens", "8",
                    "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_generate_with_a_bad_model_path_fails_with_a_typed_message(tmp_path):
    proc = run_pdrt("generate", "hello", "--model", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "model_load" in proc.stderr
