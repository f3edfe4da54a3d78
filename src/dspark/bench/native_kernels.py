"""Measure the native GGUF kernels: per-product times and a quantized-vs-dense decode A/B, in one process.

    taskset -c 0 python -m dspark.bench.native_kernels [--threads 1] [--decode-tokens 64] [--rounds 3] [--no-decode]

1. One product of SmolLM2-135M's shapes (1536x576 and 576x1536 Q4_1, 576x576 Q4_1, the 49152x576 Q8_0 lm_head) at
   M = 1 (decode), 8 (an 8-token verify) and 16: the native exact and int8 kernels against fp32 and bf16
   ``F.linear`` over the dequantized weight (best of 7 passes, the weight hot in cache; a decode step reads every
   weight from memory, where the 3.5-7x fewer bytes count more), and each kernel's time over its M = 1 time (the
   exact kernel's floor is M fp32 FMAs per weight, so its ratio approaches M where the product is compute bound).
2. SmolLM2 plain greedy decode (the ``smollm2-135m-instruct`` alias; skipped when not installed): tokens/s of the
   engine with quantization "gguf", "gguf-int8" and "none" (the dequantized export), fp32 and bf16, the variants
   interleaved round by round and the best round kept.

Every line carries ``torch.backends.cpu.get_cpu_capability()`` and the kernels' build (``dspark.native.status``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import dspark.native as native
from dspark.cli_common import add_threads_arg
from dspark.models.quantized import BLOCK_BYTES, QTYPES, QuantWeight

SHAPES = ((1536, 576, "Q4_1"), (576, 1536, "Q4_1"), (576, 576, "Q4_1"), (49152, 576, "Q8_0"))


def best_us(fn: Callable[[], object], calls: int, passes: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def random_weight(n: int, k: int, qtype: str, g: torch.Generator) -> QuantWeight:
    """Random quants under realistic fp16 scales (and Q4_1 offsets)."""
    nb = k // 32
    b = torch.randint(0, 256, (n, nb, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    b[..., :2] = (torch.rand(n, nb, 1, generator=g) * 0.01 + 1e-3).half().view(torch.uint8)
    if qtype == "Q4_1":
        b[..., 2:4] = (-torch.rand(n, nb, 1, generator=g) * 0.05).half().view(torch.uint8)
    return QuantWeight(qtype, b.view(n, -1).contiguous())


def gemv_row(ops, w: QuantWeight, m: int, g: torch.Generator) -> dict:
    """One product of ``w`` with m rows, four ways."""
    n, k, code = w.out_features, w.in_features, QTYPES[w.qtype]
    dense = w.dequantize()
    dense_bf16 = dense.bfloat16()
    x = torch.randn(m, k, generator=g)
    xb = x.bfloat16()
    calls = 5 if n > 10000 else 100
    return {
        "shape": f"{n}x{k}",
        "qtype": w.qtype,
        "M": m,
        "native_exact_us": best_us(lambda: ops.quant_linear(x, w.blocks, None, code, False), calls),
        "native_int8_us": best_us(lambda: ops.quant_linear(x, w.blocks, None, code, True), calls),
        "fp32_linear_us": best_us(lambda: F.linear(x, dense), calls),
        "bf16_linear_us": best_us(lambda: F.linear(xb, dense_bf16), calls),
    }


def gemv_rows(ops) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    weights = [random_weight(n, k, qtype, g) for n, k, qtype in SHAPES]
    rows = []
    for w in weights:
        one = gemv_row(ops, w, 1, g)
        rows.append(one)
        for m in (8, 16):
            row = gemv_row(ops, w, m, g)
            for kind in ("exact", "int8"):
                row[f"{kind}_vs_m1"] = row[f"native_{kind}_us"] / one[f"native_{kind}_us"]
            rows.append(row)
    return rows


def decode_rows(tokens: int, rounds: int) -> list[dict]:
    import warnings

    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.config import ConfigError, EngineConfig
    from dspark.engine.engine import Engine
    from dspark.llm import LLM
    from dspark.models.loading import load_target
    from dspark.sampling_params import SamplingParams
    from dspark.tokenizer import load_tokenizer

    try:
        path = resolve_model_ref("smollm2-135m-instruct")
    except ConfigError as e:
        return [{"decode": f"skipped: {e}"}]
    variants = [(q, d) for d in ("float32", "bfloat16") for q in ("gguf", "gguf-int8", "none")]
    engines, tok = {}, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for q, d in variants:
            model = load_target(path, d, quantization=q)
            if tok is None:
                c = model.config
                tok = load_tokenizer(path, c.vocab_size, c.eos_token_ids, c.bos_token_id)
            engines[q, d] = LLM.from_engine(Engine(model, None, None, EngineConfig(dtype=d), tokenizer=tok))
    prompt = tok.encode("Write a short story about a robot who learns to paint.")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(rounds):
        for key, llm in engines.items():
            t = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            best[key] = min(best[key], (time.perf_counter() - t) / len(out.token_ids))
    return [
        {"decode": "smollm2-135m-instruct", "quantization": q, "dtype": d, "tok_per_s": 1 / s, "ms_per_token": s * 1e3}
        for (q, d), s in best.items()
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_threads_arg(p, default=1, help="torch threads (default 1)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-decode", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.ops()
    head = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native": native.status(),
        "threads": args.threads,
    }
    if ops is None:
        print(json.dumps(head | {"error": "native kernels unavailable"}))
        return 1
    rows = gemv_rows(ops) + ([] if args.no_decode else decode_rows(args.decode_tokens, args.rounds))
    for row in rows:
        print(json.dumps(head | {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
