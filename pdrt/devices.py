"""Which device each worker computes on: the node's device, its GPUs one per worker, and a GPU pool's size.

`[engine] device` is `auto` (CUDA when torch sees a GPU, else the CPU),
`cpu`, `cuda` (the GPUs of `[engine] gpus`, by default every one torch
sees) or `cuda:N` (GPU N alone). On CUDA the supervisor gives each worker
process one GPU through `CUDA_VISIBLE_DEVICES`, in turn over the node's GPUs:
with more workers than GPUs, workers share one, and each takes its share of
its memory. The gateway and the controller see no GPU. Inside a worker its
GPU is `cuda` (device 0 of those it sees).

A worker's KV pool on a GPU is what is left of its share of the GPU's memory
(`[engine] gpu_memory_utilization` of the whole, split among the workers on
it) after its weights and a reserve for a step's activations; `[engine]
kv_cache_bytes` fixes it instead. On the CPU the pool is 1 GiB unless set.

A prefill worker on a GPU keeps its KV pool in device memory. `transfer =
"auto"` shares it with decode workers of its host by CUDA IPC
(pdrt/transport/cuda_ipc.py) and serves it over TCP, through pinned host
memory, to those of other hosts; `cuda_ipc` and `tcp` are each half of it.
Combinations this version cannot run are refused when the node starts:
CUDA asked where torch sees no GPU, GPU indices that do not exist, a
prefill worker on a GPU with `shm` (a pool in host memory), and CUDA IPC
without a GPU.
"""

from pdrt.errors import ConfigError

GPU_SHARING_ENV = "PDRT_GPU_SHARING"  # the supervisor tells each worker how many workers share its GPU
WORKER_ROLES = ("prefill", "decode", "colocated")


def cuda_device_count() -> int:
    """GPUs torch sees in this process (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(setting: str, num_gpus: int | None = None) -> str:
    """`auto` made concrete: "cuda" where torch sees a GPU, else "cpu"; any other setting as given."""
    if setting != "auto":
        return setting
    return "cuda" if (cuda_device_count() if num_gpus is None else num_gpus) > 0 else "cpu"


def node_gpus(device: str, gpus: str, num_gpus: int) -> list[str]:
    """The GPU indices a node of `device` spreads its workers over, checked against the `num_gpus` torch sees."""
    if not device.startswith("cuda"):
        return []
    if num_gpus == 0:
        raise ConfigError(f"[engine] device is {device!r} but torch sees no CUDA device (a CPU build of torch, "
                          "no driver, or CUDA_VISIBLE_DEVICES hides them)")
    if ":" in device:
        chosen = [device.split(":", 1)[1]]
    elif gpus.strip():
        chosen = [g.strip() for g in gpus.split(",") if g.strip()]
    else:
        chosen = [str(i) for i in range(num_gpus)]
    for g in chosen:
        if not g.isdigit() or int(g) >= num_gpus:
            raise ConfigError(f"GPU {g!r} does not exist: torch sees {num_gpus} (0 to {num_gpus - 1})")
    return chosen


def gpu_assignment(process_names: list[str], gpus: list[str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of every process: the workers one GPU each in turn, the others none ("")."""
    workers = [name for name in process_names if name.split("-", 1)[0] in WORKER_ROLES]
    assignment = dict.fromkeys(process_names, "")
    for i, name in enumerate(workers):
        assignment[name] = gpus[i % len(gpus)]
    return assignment


def gpu_sharing(assignment: dict[str, str], process: str) -> int:
    """How many workers (`process` included) compute on `process`'s GPU."""
    gpu = assignment[process]
    return sum(1 for name, g in assignment.items() if g == gpu and name.split("-", 1)[0] in WORKER_ROLES)


def gpu_pool_bytes(total_bytes: int, utilization: float, sharing: int, used_bytes: int, reserve_bytes: int) -> int:
    """A worker's KV pool on a GPU of `total_bytes`: its share of `utilization` of the memory, less what it
    uses already (weights) and `reserve_bytes` for a step's activations. Raises when nothing is left."""
    pool = int(total_bytes * utilization / sharing) - used_bytes - reserve_bytes
    if pool <= 0:
        raise ConfigError(f"no GPU memory left for the KV pool: {utilization:g} of {total_bytes / 2**30:.1f} GiB "
                          f"shared by {sharing} worker(s) is {total_bytes * utilization / sharing / 2**30:.2f} GiB, "
                          f"the weights take {used_bytes / 2**30:.2f} GiB and a step {reserve_bytes / 2**30:.2f}; "
                          "raise [engine] gpu_memory_utilization or run fewer workers per GPU")
    return pool


def activation_reserve_bytes(num_tokens: int, hidden: int, intermediate: int, vocab: int, element_size: int) -> int:
    """Memory a step of `num_tokens` may need beyond the weights and the pool: a layer's largest intermediates
    (the MLP's three projections, the attention's q/k/v/o) and the logits, twice over for the allocator."""
    per_token = 3 * intermediate + 4 * hidden + vocab
    return 2 * num_tokens * per_token * element_size


def check_device_support(device: str, mode: str, worker_counts: dict[str, int], transfer: str) -> None:
    """Refuse, before any process starts, what this version cannot run on `device`."""
    if transfer == "cuda_ipc" and not device.startswith("cuda"):
        raise ConfigError(f"transfer = 'cuda_ipc' hands KV over between GPUs; [engine] device is {device!r}")
    if device.startswith("cuda") and mode == "disaggregated" and worker_counts.get("prefill", 0) \
            and transfer == "shm":
        raise ConfigError("a prefill worker on a GPU hands its KV over from device memory; transfer = 'shm' "
                          "keeps the pool in host memory: use 'auto' (CUDA IPC on this host, TCP to others)")


def process_environments(device: str, gpus: str, mode: str, worker_counts: dict[str, int], transfer: str,
                         process_names: list[str], num_gpus: int | None = None) -> dict[str, dict[str, str]]:
    """The device variables of each process of a node (none on the CPU), after refusing what cannot run."""
    check_device_support(device, mode, worker_counts, transfer)
    if not device.startswith("cuda"):
        return {name: {} for name in process_names}
    chosen = node_gpus(device, gpus, cuda_device_count() if num_gpus is None else num_gpus)
    assignment = gpu_assignment(process_names, chosen)
    return {name: {"CUDA_VISIBLE_DEVICES": gpu, GPU_SHARING_ENV: str(gpu_sharing(assignment, name))}
            for name, gpu in assignment.items()}
