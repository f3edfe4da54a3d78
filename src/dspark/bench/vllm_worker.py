"""Stand-alone vLLM worker for ``dspark bench --vllm-python PYTHON`` (imports only vLLM and the standard library).

Run as ``PYTHON -P vllm_worker.py '<init json>'`` (``-P``: this folder stays off ``sys.path``) with init =
{"model", "dtype", "seed", "speculative_config", "max_model_len"}. It loads ``vllm.LLM`` once, then answers one
request per stdin line (prompts are token ids, passed to vLLM as ``prompt_token_ids``)::

    {"prompts": [[token ids], ...], "temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "seed"}
    -> {"output_tokens": int, "wall_s": float, "spec": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
        "accepted_per_pos"} | null}        (spec counters are cumulative; the caller takes deltas)

``{"cmd": "exit"}`` ends it. Replies are stdout lines starting with PREFIX; everything else vLLM prints goes to
stderr (the real stdout is moved aside before vLLM is imported).
"""

import json
import os
import sys
import time

PREFIX = "@@dspark-bench@@ "


def spec_counters(llm):
    try:
        metrics = llm.get_metrics()
    except Exception:  # older vLLM, or stats disabled
        return None
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    seen = False
    for m in metrics:
        name = m.name.removeprefix("vllm:").removesuffix("_total")
        if name == "spec_decode_num_accepted_tokens_per_pos":
            values = list(getattr(m, "values", []) or [])
            per = out["accepted_per_pos"]
            per.extend([0] * (len(values) - len(per)))
            for i, v in enumerate(values):
                per[i] += int(v)
            seen = True
        elif name.startswith("spec_decode_num_") and name.removeprefix("spec_decode_") in out:
            out[name.removeprefix("spec_decode_")] += int(getattr(m, "value", 0))
            seen = True
    return out if seen else None


def isolate() -> None:
    """Drop this file's folder from sys.path (``python -P`` does it at start-up; this covers a run by hand):
    ``dspark/bench`` holds ``profile.py`` and ``datasets.py``, which would shadow the modules vLLM imports."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


def load_llm(init):
    """vllm.LLM on the target dir; no tokenizer (prompts arrive as token ids), stats on for the spec counters."""
    from vllm import LLM

    kwargs = {
        "model": init["model"],
        "skip_tokenizer_init": True,
        "dtype": init.get("dtype", "bfloat16"),
        "seed": init.get("seed", 0),
        "enforce_eager": True,
        "disable_log_stats": False,
    }
    if init.get("max_model_len"):
        kwargs["max_model_len"] = init["max_model_len"]
    if init.get("speculative_config"):
        kwargs["speculative_config"] = init["speculative_config"]
    return LLM(**kwargs)


def answer(llm, msg):
    """One request: generate from exactly the given token ids; tokens, wall time and the spec counters."""
    from vllm import SamplingParams

    keys = ("temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "seed")
    sp = SamplingParams(**{k: msg[k] for k in keys})
    prompts = [{"prompt_token_ids": ids} for ids in msg["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": tokens, "wall_s": wall, "spec": spec_counters(llm)}


def main():
    isolate()
    init = json.loads(sys.argv[1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(PREFIX + json.dumps(obj) + "\n")
        proto.flush()

    try:
        llm = load_llm(init)
    except Exception as e:
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    send({"ready": True, "spec": spec_counters(llm)})
    for line in sys.stdin:
        msg = json.loads(line) if line.strip() else {}
        if msg.get("cmd") == "exit":
            break
        if not msg:
            continue
        try:
            send(answer(llm, msg))
        except Exception as e:
            send({"error": f"{type(e).__name__}: {e}"})
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
