"""The `pdrt` command line, run as a user runs it. Talking to a running server is in test_client.py."""

import os
import subprocess
import sys

from pdrt.client.server_address import default_server
from pdrt.client.spawned_server import is_listening
from pdrt.testing.node import free_port


def run_pdrt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdrt.cli", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8", **(env or {})))


def test_generate_local_streams_an_answer_from_a_checkpoint(model_dirs):
    proc = run_pdrt("generate", "def main():", "--local", "--model", str(model_dirs["llama"]), "--max-tokens", "8",
                    "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_generate_local_with_a_bad_model_path_fails_with_a_typed_message(tmp_path):
    proc = run_pdrt("generate", "hello", "--local", "--model", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "model_load" in proc.stderr


def test_generate_where_no_server_listens_fails_at_once_and_says_how_to_start_one():
    proc = run_pdrt("generate", "hello", env={"PDRT_SERVER": f"tcp://127.0.0.1:{free_port()}"})
    assert proc.returncode == 2
    assert "unreachable" in proc.stderr and "--serve" in proc.stderr


def test_generate_with_serve_starts_a_server_for_the_command_and_stops_it_after(model_dirs):
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = run_pdrt("generate", "def main():", "--serve", "--server", address, "--model", str(model_dirs["llama"]),
                    "--max-tokens", "8", env={"PDRT_KV_CACHE_BYTES": str(64 << 20)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "starting one" in proc.stderr
    assert not is_listening(address)


def test_clients_look_for_the_server_where_pdrt_up_puts_it_by_the_same_variables():
    port = free_port()
    proc = run_pdrt("generate", "hello", env={"PDRT_HOST": "127.0.0.1", "PDRT_PORT": str(port)})
    assert proc.returncode == 2 and f"nothing listens at tcp://127.0.0.1:{port}" in proc.stderr
    assert default_server({}) == "tcp://127.0.0.1:7100"
    assert default_server({"PDRT_HOST": "::1", "PDRT_PORT": "7600"}) == "tcp://[::1]:7600"
    assert default_server({"PDRT_SERVER": "tcp://10.0.0.1:7100", "PDRT_PORT": "7600"}) == "tcp://10.0.0.1:7100"
