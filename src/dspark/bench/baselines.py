"""Peer baselines on the same target weights: transformers ``generate`` (plain and prompt lookup) in-process, and
vLLM (plain and n-gram) in a persistent subprocess of another Python environment (``--vllm-python``).

Both speak the bench's ``Method`` protocol (see ``methods.py``): ``run(prompt token ids, SamplingParams)`` returns a
``Measurement``. transformers exposes no acceptance counters, so its rows carry τ = null; vLLM's come from its own
``vllm:spec_decode_*`` counters (``LLM.get_metrics()``), as deltas like ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dspark.bench.acceptance import SpecCounters
from dspark.bench.methods import Measurement
from dspark.config import TargetConfig
from dspark.models.loading import torch_dtype
from dspark.models.model_spec import model_spec
from dspark.sampling_params import SamplingParams

VLLM_WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
PROTOCOL_PREFIX = "@@dspark-bench@@ "
DEFAULT_KV_SPACE_GIB = 1


# ---- transformers -----------------------------------------------------------------------------------------------


def load_hf_target(target_dir: str | Path, dtype: str) -> Any:
    """transformers' model class for our target directory (DeepseekV3ForCausalLM, LlamaForCausalLM, ...), quietly,
    with no default EOS/sampling config."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = model_spec(target_dir).hf_config  # the config the bench already read: config.json is not read again
    # transformers merges the model's generation_config into every call; keep EOS out of it so that
    # ignore_eos can turn stopping off (EOS is passed per call instead)
    generation = GenerationConfig(bos_token_id=config.bos_token_id)
    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), config=config, generation_config=generation, dtype=torch_dtype(dtype)
    ).eval()
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id)
    return model


class HFGenerate:
    """``model.generate`` on left-padded batches; with ``prompt_lookup`` set, transformers' prompt lookup
    decoding (``prompt_lookup_num_tokens``), which runs batch size 1 only."""

    engine_backed = False

    def __init__(
        self,
        name: str,
        target_dir: str | Path,
        dtype: str,
        tcfg: TargetConfig,
        prompt_lookup: int | None = None,
        seed: int = 0,
        model: Any = None,
    ) -> None:
        self.name = name
        self.model = model if model is not None else load_hf_target(target_dir, dtype)
        self.eos = list(tcfg.eos_token_ids)
        self.pad = tcfg.pad_token_id if tcfg.pad_token_id is not None else (self.eos[0] if self.eos else 0)
        self.prompt_lookup = prompt_lookup
        self.seed = seed
        self.calls = 0

    def skip_reason(self, concurrency: int, temperature: float) -> str | None:
        if self.prompt_lookup and concurrency > 1:
            return "transformers' prompt lookup decoding runs batch size 1 only"
        return None

    def _generation_config(self, params: SamplingParams) -> Any:
        from transformers import GenerationConfig

        kw: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "eos_token_id": None if params.ignore_eos or not self.eos else self.eos,
            "pad_token_id": self.pad,
            "do_sample": not params.greedy,
        }
        if not params.greedy:
            kw |= {"temperature": params.temperature, "top_k": params.top_k or None, "top_p": params.top_p}
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup
        return GenerationConfig(**kw)

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Measurement:
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad, dtype=torch.long)  # [B, T] left-padded
        mask = torch.zeros(len(prompts), P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, P - len(p) :] = 1
        gc = self._generation_config(params)
        torch.manual_seed(self.seed + self.calls)
        self.calls += 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=gc)
        wall = time.perf_counter() - t0
        return Measurement(self._count(out[:, P:], params), wall, None)

    def _count(self, generated: torch.Tensor, params: SamplingParams) -> int:
        """Tokens each row really produced: up to and including its first EOS (the rest is padding)."""
        total = 0
        for row in generated.tolist():
            n = len(row)
            if not params.ignore_eos:
                n = next((i + 1 for i, t in enumerate(row) if t in self.eos), n)
            total += n
        return total

    def close(self) -> None:
        pass


# ---- vLLM (subprocess) --------------------------------------------------------------------------------------------


class VLLMError(RuntimeError):
    pass


def worker_command(python: str, init: dict[str, Any]) -> list[str]:
    """``python -P vllm_worker.py INIT``: -P keeps the worker's folder (``dspark/bench``, whose ``profile.py`` and
    ``datasets.py`` would shadow the modules vLLM imports) off ``sys.path``."""
    return [python, "-P", str(VLLM_WORKER), json.dumps(init)]


def worker_env(kv_space_gib: int | None = None) -> dict[str, str]:
    """The environment plus the KV space vLLM's CPU build refuses to start without (GiB; else it demands 92 % of
    memory free): the argument, else the caller's ``VLLM_CPU_KVCACHE_SPACE``, else ``DEFAULT_KV_SPACE_GIB``."""
    space = kv_space_gib or os.environ.get("VLLM_CPU_KVCACHE_SPACE") or DEFAULT_KV_SPACE_GIB
    return dict(os.environ) | {"VLLM_CPU_KVCACHE_SPACE": str(space)}


class VLLMMethod:
    """A persistent ``vllm_worker.py`` under another interpreter, isolated from our package (``worker_command``);
    one JSON line per request and per reply. Prompts go to vLLM as token ids, exactly ours."""

    engine_backed = False

    def __init__(
        self,
        name: str,
        python: str,
        target_dir: str | Path,
        speculative_config: dict[str, Any] | None,
        dtype: str,
        seed: int = 0,
        max_model_len: int | None = None,
        env: dict[str, str] | None = None,
        kv_space_gib: int | None = None,
    ) -> None:
        self.name = name
        self.seed = seed
        self.calls = 0
        self.has_spec = speculative_config is not None
        init = {
            "model": str(target_dir),
            "dtype": dtype,
            "seed": seed,
            "speculative_config": speculative_config,
            "max_model_len": max_model_len,
        }
        self.log = tempfile.NamedTemporaryFile(prefix=f"dspark-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            worker_command(python, init),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env=worker_env(kv_space_gib) | (env or {}),
        )
        ready = self._read()
        self.last = self._counters(ready)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                raise VLLMError(
                    f"{self.name}: the vLLM worker exited (code {self.proc.returncode}); its log: {self.log.name}\n"
                    + self._log_tail()
                )
            if line.startswith(PROTOCOL_PREFIX):
                msg = json.loads(line[len(PROTOCOL_PREFIX) :])
                if "error" in msg:
                    raise VLLMError(f"{self.name}: vLLM worker error: {msg['error']} (log: {self.log.name})")
                return msg

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @staticmethod
    def _counters(msg: dict[str, Any]) -> SpecCounters | None:
        s = msg.get("spec")
        if not s:
            return None
        drafts, draft_tokens = int(s["num_drafts"]), int(s["num_draft_tokens"])
        return SpecCounters(
            num_drafts=drafts,
            num_draft_tokens=draft_tokens,
            num_accepted_tokens=int(s["num_accepted_tokens"]),
            accepted_per_pos=tuple(int(x) for x in s.get("accepted_per_pos", [])),
            verify_tokens=draft_tokens + drafts,  # vLLM verifies every draft token plus one row per draft
        )

    def skip_reason(self, concurrency: int, temperature: float) -> str | None:
        return None

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Measurement:
        assert self.proc.stdin is not None
        request = {
            "prompts": [list(p) for p in prompts],
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k or -1,
            "max_tokens": params.max_tokens,
            "ignore_eos": params.ignore_eos,
            "seed": self.seed + self.calls,
        }
        self.calls += 1
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise VLLMError(f"{self.name}: the vLLM worker is gone; log: {self.log.name}\n{self._log_tail()}") from e
        reply = self._read()
        now = self._counters(reply)
        delta = now - self.last if (now is not None and self.last is not None) else now
        self.last = now
        return Measurement(int(reply["output_tokens"]), float(reply["wall_s"]), delta if self.has_spec else None)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.proc.returncode == 0:  # a clean exit: nothing in the log to look at (errors keep theirs)
            Path(self.log.name).unlink(missing_ok=True)
