"""The compiled decode-attention kernel for float32 on the CPU: built once per machine, loaded with ctypes.

On the CPU, gathering every decoding sequence's blocks into a padded batch
and calling SDPA costs more than the rest of attention: the gather writes
and reads the whole batch's KV again every layer, and SDPA's kernel is made
for many query rows, not one. `csrc/paged_decode_attention.c` reads each
sequence's keys and values where they lie in the pool instead.

The source is compiled at first use with the system's C compiler and the
machine's own vector instructions, into the pdrt cache directory, keyed by
the source, the flags, the compiler and the CPU, so a cache shared between
machines never hands one a binary built for another. OpenMP in the kernel
resolves to the libgomp that torch has already loaded (one thread pool, and
torch's thread count is passed on every call). Without a compiler, on other
devices or dtypes, or with PDRT_CPU_KERNELS=0, `load()` returns None and
attention gathers and calls SDPA as before.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import structlog
import torch

from pdrt.models.fetch import cache_dir

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
COMPILE_TIMEOUT_S = 120.0


class PagedDecodeKernel:
    """`paged_decode_attention` of the compiled library, with its C signature declared once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.function = library.paged_decode_attention
        i64 = ctypes.c_int64
        self.function.argtypes = [ctypes.c_void_p] * 6 + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
        self.function.restype = ctypes.c_int

    def __call__(self, query: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                 block_tables: torch.Tensor, lengths: torch.Tensor, max_len: int, block_size: int,
                 num_kv_heads: int, scale: float) -> torch.Tensor:
        """query `[seqs, heads, head_dim]` contiguous float32; one layer's K and V blocks; int64 tables
        `[seqs, max_blocks]` and lengths `[seqs]` -> `[seqs, heads, head_dim]`."""
        num_seqs, num_heads, head_dim = query.shape
        out = torch.empty_like(query)
        status = self.function(query.data_ptr(), k_blocks.data_ptr(), v_blocks.data_ptr(), block_tables.data_ptr(),
                               lengths.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
                               block_size, block_tables.shape[1], max_len, scale, torch.get_num_threads())
        if status == -2:
            raise ValueError(f"the decode-attention kernel needs head_dim a multiple of 16, got {head_dim}")
        if status != 0:
            raise MemoryError("the decode-attention kernel could not allocate its scratch memory")
        return out


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and head_dim % 16 == 0


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """What the binary depends on: the architecture and, on Linux, the CPU's model and feature flags."""
    lines = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    lines.append(line.strip())
                if line.strip() == "":
                    break  # the first CPU describes them all
    except OSError:
        pass
    return "\n".join(lines)


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature()])
                         .encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Processes of one node start together: each builds its own file and renames it into place.
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


@functools.cache
def load() -> PagedDecodeKernel | None:
    """The kernel, built if needed; None where it cannot be (attention then gathers and calls SDPA)."""
    if os.environ.get("PDRT_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler: decode attention gathers KV and calls SDPA (slower)")
        return None
    try:
        return PagedDecodeKernel(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        log.warning("decode-attention kernel unavailable; gathering KV for SDPA instead", error=detail[-2000:])
        return None
