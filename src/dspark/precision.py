"""The dtype and weight format a target is served in: ``dtype="auto"`` and ``quantization="auto"`` resolved for this
machine and this model (the defaults of ``EngineConfig``, so of every command and of ``LLM``).

- quantization "auto": "gguf" for a model that came from a .gguf file (its export records the file) when the
  native kernels run here and the model's family uses them, else "none" (``dspark.models.loading.choose_quantization``).
  Only the target is quantized; a drafter stays dense.
- dtype "auto": float32 when the target is served quantized (the kernels take fp32 activations, and fp32 beats bf16
  there); else bfloat16 where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX: the ``avx512_bf16`` /
  ``amx_bf16`` flags of /proc/cpuinfo, with torch dispatching its AVX-512 kernels), else float32 (without those
  instructions every bf16 product converts to fp32 first).

The machine half (bf16 or not) is cached per machine in ``$DSPARK_CACHE/dtype.json``, keyed as the thread default
is (CPU model, torch version, CPU capability), and the key also names the bf16 flags found. Both halves for one
model: ``dspark.models.loading.resolve_precision`` (it reads the model, so it lives with the loaders).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspark.config import AUTO, DTYPE_CHOICES, ConfigError
from dspark.threads import cpu_model, read_cache, write_cache

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 instructions that multiply bf16 without converting it first


@dataclass(frozen=True)
class Precision:
    """What a target is served in here, and why: ``dtype`` and ``quantization`` are never "auto"."""

    dtype: str  # "bfloat16" | "float16" | "float32"
    quantization: str  # "none" | "gguf" | "gguf-exact"
    cpu_capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    dtype_why: str
    quantization_why: str

    def describe(self) -> str:
        return (
            f"dtype {self.dtype} ({self.dtype_why}); quantization {self.quantization} ({self.quantization_why}); "
            f"CPU capability {self.cpu_capability}"
        )

    def to_json(self) -> dict[str, str]:
        return asdict(self)


TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype name ("bfloat16", "float32", "float16") as its torch dtype; a torch dtype as itself."""
    if isinstance(name, torch.dtype):
        return name
    if name not in TORCH_DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo ``flags``, ``Features`` on Arm); empty where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() in ("flags", "Features"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def native_bf16(flags: frozenset[str], capability: str) -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 natively (and torch's kernels use it), and why."""
    found = [f for f in BF16_FLAGS if f in flags]
    if not found:
        return False, "no avx512_bf16/amx_bf16 on this CPU: bf16 products would convert to fp32 first"
    if not capability.upper().startswith("AVX512"):
        return False, f"{'+'.join(found)} present, but torch runs its {capability} kernels"
    return True, f"{'+'.join(found)}: this CPU multiplies bf16 natively"


def machine_dtype() -> tuple[str, str]:
    """bfloat16 or float32 for a dense target on this machine, and why; cached per machine (module docstring)."""
    flags, capability = cpu_flags(), cpu_capability()
    bf16 = "+".join(f for f in BF16_FLAGS if f in flags) or "no bf16 flags"
    key = f"{cpu_model()}|torch {torch.__version__}|{capability}|{bf16}"
    path = _cache_path()
    cache = read_cache(path)
    hit = cache.get(key)
    if isinstance(hit, dict) and hit.get("dtype") in ("bfloat16", "float32") and isinstance(hit.get("why"), str):
        return hit["dtype"], hit["why"]
    native, why = native_bf16(flags, capability)
    dtype = "bfloat16" if native else "float32"
    cache[key] = {"dtype": dtype, "why": why}
    write_cache(path, cache)  # a read-only home: decided again next time (it is cheap)
    return dtype, why


def _cache_path() -> Path:
    from dspark.paths import cache_root  # $DSPARK_CACHE, default ~/.cache/dspark

    return cache_root() / "dtype.json"


def choose_dtype(dtype: str, quantization: str) -> tuple[str, str]:
    """A concrete dtype for ``dtype`` ("auto" or a name) and the target's resolved ``quantization``, and why."""
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {list(DTYPE_CHOICES)}")
    if dtype != AUTO:
        return dtype, "as asked"
    if quantization != "none":
        return "float32", "auto: the quantized target's kernels take fp32 activations"
    name, why = machine_dtype()
    return name, f"auto: {why}"


