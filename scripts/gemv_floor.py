"""What one decode step's matrix products cost on this machine, and how close they run to its memory bandwidth.

At one token per step every weight matrix is read once per token, so a dense model's decode step has a floor: the
bytes of its weights over the bandwidth a GEMV reaches. This script measures, on one thread (or --num-threads):

- the streaming-read bandwidth of one core (the sum of a 256 MiB fp32 tensor);
- the model's own weight matrices (every ``nn.Linear`` plus the lm_head, bf16) as one-row products, run the ways
  torch offers: oneDNN on a prepacked copy (what the engine runs), ``F.linear`` on the plain weight, and an
  inductor-generated GEMV (``torch.compile`` of a broadcast multiply and sum, fp32 accumulation). q/k/v and
  gate/up run as separate products here (the engine fuses each group into one), so the per-call overhead is a
  little higher than the engine's.

It prints one JSON object (best of ``--repeats`` passes, alternated). Usage:

    .venv/bin/python scripts/gemv_floor.py --model smollm2-135m-instruct [--num-threads 1] [--no-inductor]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from dspark.llm import resolve_model
from dspark.models.loading import load_target
from dspark.models.packing import PACK_ROWS_HINT, can_pack


def weights_of(target: nn.Module) -> list[torch.Tensor]:
    """Every Linear weight and the lm_head (tied or not), each counted once by storage."""
    seen, out = set(), []
    mats = [m.weight for m in target.modules() if isinstance(m, nn.Linear)] + [target.lm_head.weight]
    for w in mats:
        key = (w.data_ptr(), tuple(w.shape))
        if key not in seen:
            seen.add(key)
            out.append(w.detach())
    return out


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-inductor", action="store_true", help="skip the torch.compile variant (needs a C++ compiler)")
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    target = load_target(resolve_model(args.model), "bfloat16")
    ws = weights_of(target)
    if not all(can_pack(w) for w in ws):
        raise SystemExit("gemv_floor: oneDNN cannot pack bf16 weights on this machine (no bf16 support)")
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {w.shape[1] for w in ws}}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in ws]

    def run_packed():
        for w, pw in zip(ws, packed):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], pw, None, "none", [None], "")

    def run_linear():
        for w in ws:
            F.linear(xs[w.shape[1]], w)

    variants = {"onednn_prepacked": run_packed, "f_linear_plain": run_linear}
    if not args.no_inductor:
        gemv = torch.compile(lambda x, w: (x.float()[:, None, :] * w.float()[None]).sum(-1).to(x.dtype))

        def run_inductor():
            for w in ws:
                gemv(xs[w.shape[1]], w)

        variants["inductor_gemv"] = run_inductor
    stream = torch.randn(64 << 20)  # 256 MiB fp32
    variants["stream_read"] = lambda: stream.sum()
    best = {name: float("inf") for name in variants}
    with torch.inference_mode():
        for fn in variants.values():  # first calls off the clock (oneDNN kernel creation, inductor compile)
            fn()
        for _ in range(args.repeats):  # alternated passes: a busy minute hits every variant alike
            for name, fn in variants.items():
                best[name] = min(best[name], seconds(fn))
    report = {
        "model": args.model,
        "threads": args.num_threads,
        "weight_matrices": len(ws),
        "weight_mib": round(nbytes / 2**20, 1),
        "stream_read_gb_s": round(stream.numel() * 4 / best.pop("stream_read") / 1e9, 1),
        "gemv": {k: {"ms": round(s * 1e3, 2), "gb_s": round(nbytes / s / 1e9, 1)} for k, s in best.items()},
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
