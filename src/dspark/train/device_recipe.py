"""One command for a lent accelerator: regenerate, train the drafter, evaluate it, bring it back.

Three steps, each a subcommand of ``python -m dspark.train.device_recipe`` (docs/training.md walks through them):

- ``prepare`` (here): the next training prompts rendered to ids (``sharegpt_regen.export_prompts``: the device has
  neither the ShareGPT file nor a need for it), then the payload packed for the device calls (``device_pack``):
  the target's GGUF, the warm-start drafter, the prompts, and the wheels the device lacks (``gguf``);
- ``run`` (there, through ``scripts/device-train.sh``): within ``--budget-minutes`` (default 8) it regenerates
  the prompts with the static generator (``--regen-share`` of the budget at most; shards as ``draft-data
  --source sharegpt`` writes them), trains the DSpark drafter warm-started from the shipped one (the recipe below,
  time-scheduled so the cosine ends with the budget) and, with ``--dflash``, the DFlash twin on the same data; the
  held-out τ of the start and of every evaluation is in the log (τ against tokens seen and device-minutes); then it
  writes the bf16 drafters, their logs and the new shards to ``$OUT`` in parts the device tool brings back (≤ 8
  files, ≤ 16 MiB);
- ``collect`` (here): joins those parts, checks them, puts the new shards beside the committed ones and the
  drafters under ``--dest``.

``run --tiny`` is the dry run: a tiny GQA pair, a synthetic ShareGPT file, the same calls on the CPU in seconds
(the test suite runs it, so device minutes are never spent debugging).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from dspark.train import device_pack

DEFAULT_DATA = "data/regen/smollm2-135m-instruct"
DEFAULT_TARGET = "smollm2-135m-instruct"
SUMMARY = "device-train.json"
RESERVE_MINUTES = 0.6  # kept back from training for the final evaluation, export and the result parts


@dataclass(frozen=True)
class DeviceTrainConfig:
    budget_minutes: float = 8.0  # the whole run, loading and regeneration included
    target: str = DEFAULT_TARGET  # a model reference (a GGUF file on the device)
    drafter: str | None = None  # warm start; None: the DSpark drafter shipped for the target
    data_dir: str = DEFAULT_DATA  # the committed shards (copied, never written)
    prompts_file: str | None = None  # prompts to regenerate first (export_prompts); None: train on the shards
    work_dir: str = "runs/device"
    out: str | None = None  # the result parts; None: $OUT, else WORK_DIR/out
    device: str = "auto"
    regen_share: float = 0.35  # of the budget, at most, for regeneration
    regen_batch: int = 256  # prompts per static batch
    dflash: bool = False  # also train the DFlash twin on the same data
    dflash_share: float = 0.3  # of the training minutes, for the twin
    batch_size: int = 64
    num_anchors: int = 64
    lr: float = 3e-4
    eval_interval: int = 50
    eval_max_samples: int = 64
    max_steps: int | None = None  # instead of the time-derived horizon (the dry run)
    max_train_tokens: int | None = None  # the token horizon instead of the time-derived one
    seed: int = 0
    tiny: bool = False

    def __post_init__(self) -> None:
        if self.budget_minutes <= RESERVE_MINUTES:
            raise ValueError(f"--budget-minutes {self.budget_minutes}: must exceed {RESERVE_MINUTES}")
        for name in ("regen_share", "dflash_share"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must lie in [0, 1)")


class Clock:
    def __init__(self, budget_minutes: float) -> None:
        self.t0, self.budget = time.perf_counter(), budget_minutes

    def minutes(self) -> float:
        return (time.perf_counter() - self.t0) / 60

    def left(self) -> float:
        return self.budget - self.minutes()


def say(msg: str) -> None:
    print(f"device-train: {msg}", file=sys.stderr, flush=True)


# ---- run (on the device) ---------------------------------------------------------------------------------------


def run(cfg: DeviceTrainConfig) -> dict[str, Any]:
    """The whole device run → its summary (also written to the results)."""
    from dspark.device import resolve_device

    clock = Clock(cfg.budget_minutes)
    device = resolve_device(cfg.device)
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(cfg.out or os.environ.get("OUT") or work / "out")
    if cfg.tiny:
        cfg = tiny_fixtures(cfg, work)
    data = work / "data"
    copy_shards(Path(cfg.data_dir), data)
    before = {p.name for p in data.glob("*.npz")}
    summary: dict[str, Any] = {"config": asdict(cfg), "device": device_name(device), "torch": _torch_version()}
    say(f"{summary['device']}, budget {cfg.budget_minutes} min, data {len(before)} shards")
    if cfg.prompts_file and cfg.regen_share > 0:
        summary["regen"] = regenerate(cfg, data, cfg.regen_share * cfg.budget_minutes)
    merge(data)
    new = sorted({p.name for p in data.glob("*.npz")} - before - {"train.npz", "validation.npz"})
    summary["minutes_regen"] = round(clock.minutes(), 2)
    train_minutes = clock.left() - RESERVE_MINUTES
    twin = train_minutes * cfg.dflash_share if cfg.dflash else 0.0
    summary["dspark"] = train(cfg, data, work / "dspark", train_minutes - twin, dflash=False)
    if cfg.dflash:
        summary["dflash"] = train(cfg, data, work / "dflash", clock.left() - RESERVE_MINUTES, dflash=True)
    summary["minutes_total"] = round(clock.minutes(), 2)
    summary["new_shards"] = new
    write_results(out, work, data, new, summary)
    say(f"done in {summary['minutes_total']} min: results in {out}")
    return summary


def device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"cpu ({torch.backends.cpu.get_cpu_capability()})"


def _torch_version() -> str:
    import torch

    return torch.__version__


def copy_shards(src: Path, dest: Path) -> None:
    """The committed shards and their manifest into the run's own data dir (the tracked ones stay untouched)."""
    dest.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        return
    for p in sorted(src.glob("*")):
        if p.name.endswith(".npz") and p.name not in ("train.npz", "validation.npz") or p.name == "manifest.json":
            shutil.copy2(p, dest / p.name)


def regen_config(cfg: DeviceTrainConfig, data: Path, minutes: float) -> Any:
    """The committed run's settings (so the prompt indices, seeds and sampling match its shards), on this device."""
    from dspark.train.draft_data import DraftDataConfig, config_from_manifest

    manifest = data / "manifest.json"
    base = DraftDataConfig(source="sharegpt")
    if manifest.is_file():
        base = config_from_manifest(json.loads(manifest.read_text()).get("config", {}), "sharegpt")
    return replace(
        base, target=cfg.target, out_dir=str(data), prompts_file=cfg.prompts_file, num_prompts=None,
        device=cfg.device, generator="static", batch_size=cfg.regen_batch, dtype="auto", quantization="none",
        max_minutes=max(minutes, 0.01),
    )  # fmt: skip


def regenerate(cfg: DeviceTrainConfig, data: Path, minutes: float) -> dict[str, Any]:
    from dspark.train.sharegpt_regen import regenerate as regen

    manifest = regen(regen_config(cfg, data, minutes), say=say)
    last = manifest["runs"][-1]
    return {k: last.get(k) for k in ("generated_tokens", "generated_tokens_per_s", "generator", "device", "dtype")}


def merge(data: Path) -> None:
    """train.npz / validation.npz from the shards (the layout train-draft reads)."""
    from dspark.train.draft_data import TRAIN_FILE, VALIDATION_FILE
    from dspark.train.sharegpt_regen import merge_shards

    for split, name in (("train", TRAIN_FILE), ("validation", VALIDATION_FILE)):
        ds = merge_shards(data, split)
        if ds is None:
            raise FileNotFoundError(f"{data}: no {split} shards; copy them there or pass --prompts-file")
        ds.save(data / name)


def drafter_of(cfg: DeviceTrainConfig) -> Path:
    if cfg.drafter:
        return Path(cfg.drafter)
    from dspark.checkpoint.resolve import bundled_drafters

    shipped = bundled_drafters(cfg.target).get("dspark")
    if shipped is None or not shipped.available:
        raise FileNotFoundError(f"no DSpark drafter is shipped for {cfg.target!r}; pass --drafter DIR")
    return shipped.path


def train(cfg: DeviceTrainConfig, data: Path, out_dir: Path, minutes: float, dflash: bool) -> dict[str, Any]:
    """One drafter run: DSpark warm-started from ``drafter_of(cfg)`` (its shape, its draft vocabulary), or the
    DFlash twin from scratch with the same taps → what the summary keeps of its log."""
    from dspark.train.draft_config import DraftTrainConfig
    from dspark.train.trainer import train_draft

    drafter = drafter_of(cfg)
    shape = json.loads((drafter / "config.json").read_text())
    horizon: dict[str, Any] = {"max_minutes": max(minutes, 0.05)}
    if cfg.max_steps is not None:
        horizon = {"max_steps": cfg.max_steps}
    elif cfg.max_train_tokens is not None:
        horizon |= {"max_train_tokens": cfg.max_train_tokens}
    vocab = drafter / "draft_vocab.json"
    tcfg = DraftTrainConfig(
        target_dir=cfg.target, data_dir=str(data), out_dir=str(out_dir), features="online", device=cfg.device,
        dflash=dflash, num_layers=int(shape["num_hidden_layers"]), markov_rank=int(shape.get("markov_rank") or 0),
        target_layer_ids=tuple(shape["target_layer_ids"]), block_size=int(shape.get("block_size") or 7),
        init_from=None if dflash else str(drafter), draft_vocab=str(vocab) if vocab.is_file() else None,
        batch_size=cfg.batch_size, num_anchors=cfg.num_anchors, lr=cfg.lr, min_lr_ratio=0.1, warmup_steps=10,
        probe_steps=4, eval_interval=cfg.eval_interval, eval_max_samples=cfg.eval_max_samples, eval_num_anchors=64,
        ckpt_interval=1 << 30, log_interval=10, seed=cfg.seed, **horizon,
    )  # fmt: skip
    if out_dir.exists():
        shutil.rmtree(out_dir)
    say(f"{'DFlash' if dflash else 'DSpark'}: {minutes:.1f} min of training from {drafter}")
    result = train_draft(tcfg)
    log = json.loads((Path(result.export_dir or "") / "training_log.json").read_text())
    curve = [
        {"step": e["step"], "tokens": e["tokens"], "minutes": round(e["train_s"] / 60, 3)}
        | {"tau": e["tau_probabilistic"]}
        for e in log["eval"]
    ]
    return {
        "steps": result.steps, "stopped_by": result.stopped_by, "export": result.export_dir,
        "tau_start": curve[0]["tau"] if curve and not dflash else None, "tau_end": curve[-1]["tau"] if curve else None,
        "tokens_seen": log["train"][-1]["tokens"] if log["train"] else 0, "curve": curve,
    }  # fmt: skip


def write_results(out: Path, work: Path, data: Path, new_shards: Sequence[str], summary: dict[str, Any]) -> None:
    """The drafters, the new shards (with the manifest) and the summary as parts the device tool brings back."""
    out.mkdir(parents=True, exist_ok=True)
    parts = summary.setdefault("parts", {})
    for name in ("dspark", "dflash"):
        if name in summary and summary[name]["export"]:
            parts[name] = device_pack.split_results([(name, Path(summary[name]["export"]))], out, name)
    if new_shards:
        items = [(f"shards/{n}", data / n) for n in [*new_shards, "manifest.json"]]
        parts["shards"] = device_pack.split_results(items, out, "shards")
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    device_pack.check_result_files(out)


# ---- the dry run's fixtures -------------------------------------------------------------------------------------


def tiny_fixtures(cfg: DeviceTrainConfig, work: Path) -> DeviceTrainConfig:
    """A tiny GQA pair, a synthetic ShareGPT file, two shards of it regenerated as committed shards would be, and a
    prompts file for the next ones: the device run's inputs, in seconds on a CPU."""
    from dspark.models.tiny import write_tiny_gqa_pair
    from dspark.train.draft_data import DraftDataConfig
    from dspark.train.sharegpt_regen import export_prompts
    from dspark.train.sharegpt_regen import regenerate as regen

    root = work / "tiny"
    target, _ = write_tiny_gqa_pair(root / "pair", seed=cfg.seed)
    source = root / "sharegpt.json"
    convs = []
    for i in range(60):
        turns = [("human", f"question {i} about topic {i % 7}"), ("gpt", f"answer {i}")]
        convs.append({"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]})
    source.write_text(json.dumps(convs))
    committed = root / "committed"
    rcfg = DraftDataConfig(
        source="sharegpt", target=str(target), sharegpt_file=str(source), out_dir=str(committed), num_prompts=16,
        num_val_prompts=4, max_prompt_tokens=64, max_new_tokens=12, min_response_tokens=1, shard_size=8, max_num_seqs=4,
        dtype="float32", quantization="none", heldout_percent=10.0, device="cpu", generator="engine",
    )  # fmt: skip
    regen(rcfg, say=lambda m: None)
    merge(committed)
    shipped = _shipped_tiny_drafter(str(target), committed, root / "shipped")
    prompts = root / "prompts.npz"
    export_prompts(rcfg, prompts, start=16, count=24)
    return replace(
        cfg, target=str(target), drafter=str(shipped), data_dir=str(committed), prompts_file=str(prompts),
        device="cpu", regen_batch=8, batch_size=4, num_anchors=4, eval_interval=2, eval_max_samples=4,
        max_steps=cfg.max_steps or 4, dflash=True,
    )  # fmt: skip


def _shipped_tiny_drafter(target: str, data: Path, out: Path) -> Path:
    """The dry run's stand-in for a shipped drafter: one train-draft step on the committed shards → its export."""
    from dspark.train.draft_config import DraftTrainConfig
    from dspark.train.trainer import train_draft

    cfg = DraftTrainConfig(
        target_dir=target, data_dir=str(data), out_dir=str(out), max_steps=1, markov_rank=8, batch_size=2,
        num_anchors=4, eval_interval=1, eval_max_samples=2, device="cpu", progress=False,
    )  # fmt: skip
    return Path(str(train_draft(cfg).export_dir))


# ---- prepare and collect (here) ----------------------------------------------------------------------------------


def travelling_bytes(repo: Path) -> int:
    """What a device call carries of the working tree: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo, capture_output=True,
        check=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum((repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file())


def prepare(args: argparse.Namespace) -> int:
    from dspark.checkpoint.gguf import gguf_source
    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.train.draft_data import config_from_manifest
    from dspark.train.sharegpt_regen import export_prompts

    repo = Path(args.repo).resolve()
    tree = travelling_bytes(repo)
    if tree > device_pack.CALL_LIMIT // 4:
        raise device_pack.PackError(
            f"{repo}: the working tree carries {tree / 2**20:.0f} MiB to every call; run `bash scripts/device-slim.sh "
            "on` first (it untracks the bundled weights for the calls; `off` restores them)"
        )
    data = Path(args.data_dir)
    rcfg = config_from_manifest(json.loads((data / "manifest.json").read_text())["config"], "sharegpt")
    start = len(list(data.glob("shard-*.npz"))) * rcfg.shard_size + args.skip_prompts
    work = Path(args.out).with_name(Path(args.out).name + "-build")
    work.mkdir(parents=True, exist_ok=True)
    info = export_prompts(replace(rcfg, target=args.target), work / "prompts.npz", start, args.prompts)
    gguf = gguf_source(resolve_model_ref(args.target))  # the file itself: 3× smaller than its dense export
    items = [("target", gguf or Path(resolve_model_ref(args.target))), ("drafter", Path(args.drafter))]
    items += [("data", work / "prompts.npz")] + [("wheel", Path(w)) for w in args.wheel]
    room = device_pack.CALL_LIMIT - tree - 2**20  # a MiB kept for the manifest and the stash script
    manifest = device_pack.pack(items, Path(args.out), room, room)
    print(json.dumps({"prompts": info, "tree_bytes": tree, "chunks": manifest["chunks"]}, indent=1))
    return 0


def collect(args: argparse.Namespace) -> int:
    """Join the fetched parts: drafters under --dest, new shards into --data-dir (an existing shard is kept)."""
    src, dest, data = Path(args.src), Path(args.dest), Path(args.data_dir)
    index = src / SUMMARY
    if not index.is_file():
        raise device_pack.PackError(f"{index}: missing; the device run did not finish (read its output)")
    summary = json.loads(index.read_text())
    got = {stem: device_pack.join(src, meta, dest) for stem, meta in summary.get("parts", {}).items()}
    shutil.copy2(index, dest / SUMMARY)
    shards, added = dest / "shards", []
    for p in sorted(shards.glob("*.npz")) if shards.is_dir() else []:
        if not (data / p.name).exists():  # a shard written here meanwhile (same index) is kept
            shutil.copy2(p, data / p.name)
            added.append(p.name)
    if added and (shards / "manifest.json").is_file():
        shutil.copy2(shards / "manifest.json", data / "manifest.json")
    print(json.dumps({"joined": got, "shards_added": added}, indent=1))
    return 0


# ---- command line ------------------------------------------------------------------------------------------------

_FLAGS = {f.name: f for f in fields(DeviceTrainConfig)}


def _add_run(sub: argparse._SubParsersAction) -> None:
    from dspark.cli_common import add_device_arg

    p = sub.add_parser("run", help="(device) regenerate, train, evaluate, write the results to $OUT")
    for f in fields(DeviceTrainConfig):
        if f.name == "device":
            add_device_arg(p)
        elif isinstance(f.default, bool):
            p.add_argument("--" + f.name.replace("_", "-"), action="store_true")
        else:
            kind = {int: int, float: float}.get(type(f.default), str)
            if f.name in ("max_steps", "max_train_tokens"):
                kind = int
            p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.train.device_recipe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_run(sub)
    a = sub.add_parser("prepare", help="(here) prompts as ids + the payload packed for the device calls")
    a.add_argument("--target", default=DEFAULT_TARGET)
    a.add_argument("--drafter", default="src/dspark/assets/smollm2-135m-dspark")
    a.add_argument("--data-dir", default=DEFAULT_DATA)
    a.add_argument("--prompts", type=int, default=None, help="how many new prompts (default: every one left)")
    a.add_argument("--skip-prompts", type=int, default=0, help="start this many prompts after the committed shards")
    a.add_argument("--wheel", action="append", default=[], help="a wheel the device lacks (gguf), repeatable")
    a.add_argument("--out", default=".devpack")
    a.add_argument("--repo", default=".")
    c = sub.add_parser("collect", help="(here) join the fetched results")
    c.add_argument("src")
    c.add_argument("--dest", default="runs/device")
    c.add_argument("--data-dir", default=DEFAULT_DATA)
    args = p.parse_args(argv)
    try:
        if args.cmd == "prepare":
            return prepare(args)
        if args.cmd == "collect":
            return collect(args)
        values = {k: getattr(args, k) for k in _FLAGS if getattr(args, k, None) is not None}
        print(json.dumps(run(DeviceTrainConfig(**values)), indent=1))
        return 0
    except (device_pack.PackError, ValueError, FileNotFoundError) as e:
        print(f"device-train: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
