"""The drafter a run trains: built for the target (init, the target's final norm, optional target layers or an
earlier run's weights as its start), its reduced training vocabulary, and ``BlockForward``, the training forward
over packed blocks that DDP wraps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspark.config import POSITION_KEYS
from dspark.models.drafter import DSparkDrafter
from dspark.train.anchors import block_positions, block_visibility
from dspark.train.checkpoint import checkpoint_path
from dspark.train.draft_config import DraftTrainConfig


class BlockForward(nn.Module):
    """The drafter's training forward over packed blocks (the module DDP wraps)."""

    def __init__(self, drafter: DSparkDrafter, absorbed: bool = True, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.absorbed = absorbed
        self.vocab_ids = vocab_ids  # [N] a reduced draft vocabulary: logits over these target ids only
        self.head_rows = None  # the (frozen) lm_head's rows of those ids, sliced once
        if vocab_ids is not None:
            assert drafter.lm_head is not None
            self.head_rows = drafter.lm_head.weight.detach().index_select(0, vocab_ids)

    def forward(
        self,
        block_ids: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        labels: torch.Tensor,
        taps: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """block_ids/labels [B, A, K], anchors/keep [B, A], taps [B, S, m·D] → (teacher-forced, Markov-corrected
        draft logits fp32 [B, A, K, V] (V: N with a reduced vocabulary), confidence logits [B, A, K] or None)."""
        B, A, K = block_ids.shape
        S = taps.shape[1]
        d = self.drafter
        ctx_positions = torch.arange(S, device=taps.device).expand(B, S)
        out = d(
            block_ids.reshape(B, A * K),
            block_positions(anchors, K),
            block_visibility(S, anchors, keep, K),
            ctx_taps=taps,
            ctx_positions=ctx_positions,
            absorbed=self.absorbed,
            compute_logits=self.head_rows is None,
        )
        base = out.base_logits if self.head_rows is None else F.linear(out.hidden, self.head_rows).float()
        assert base is not None
        logits = base.view(B, A, K, -1)
        hidden = out.hidden.view(B, A, K, -1)
        prev_embeds = None
        if d.markov_head is not None:
            prev = torch.cat((block_ids[..., :1], labels[..., :-1]), -1)  # [anchor, labels[:-1]]
            logits, prev_embeds = d.markov_head.teacher_forced(logits, hidden, prev, self.vocab_ids)
        return logits.float(), d.confidence(hidden, prev_embeds)


def train_vocab_ids(cfg: DraftTrainConfig, vocab_size: int) -> torch.Tensor | None:
    """The reduced draft vocabulary a run trains over (cfg.draft_vocab), or None for the full vocabulary."""
    from dspark.speculative.draft_vocab import read_draft_vocab

    if cfg.draft_vocab is None:
        return None
    src = Path(cfg.draft_vocab)
    if not src.exists():
        raise FileNotFoundError(f"--draft-vocab {src}: no such draft_vocab.json or drafter directory")
    if not src.is_dir() and src.name != "draft_vocab.json":
        raise ValueError(f"--draft-vocab {src}: give a draft_vocab.json file or the directory that holds one")
    return read_draft_vocab(src if src.is_dir() else src.parent, cfg.draft_vocab_size, vocab_size)


def init_drafter_(drafter: DSparkDrafter, std: float, generator: torch.Generator) -> None:
    """N(0, std) matrices (std/sqrt(2L) for o_proj/down_proj), ones for norms, zero biases."""
    resid = std / math.sqrt(2 * max(1, drafter.config.num_hidden_layers))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.ndim == 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, resid, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def build_drafter(cfg: DraftTrainConfig, target: nn.Module) -> DSparkDrafter:
    drafter = DSparkDrafter(cfg.draft_config(target.config))
    init_drafter_(drafter, cfg.init_std, torch.Generator().manual_seed(cfg.seed))
    if cfg.init_layers_from_target is not None:
        copy_target_layers_(drafter, target, cfg.init_layers_from_target)
    norm = target_final_norm(target)
    if norm is not None and norm.shape == drafter.final_norm.weight.shape:
        with torch.no_grad():  # the borrowed lm_head then sees states at the target's scale from step 0
            drafter.final_norm.weight.copy_(norm)
    drafter.attach(target.embed_tokens, target.lm_head)
    return drafter.float().train()


def copy_target_layers_(drafter: DSparkDrafter, target: nn.Module, ids: Sequence[int]) -> int:
    """Start drafter layer i from target layer ids[i]: every tensor whose name and shape agree is copied (the
    drafter's extra tensors, e.g. q/k norms a Llama target lacks, keep their init). → tensors copied."""
    layers = getattr(getattr(target, "model", None), "layers", None)
    mine = drafter.layers
    if layers is None:
        raise ValueError("--init-layers-from-target: the target has no model.layers to copy from")
    if len(ids) != len(mine) or any(not 0 <= j < len(layers) for j in ids):
        raise ValueError(
            f"--init-layers-from-target {list(ids)}: give one target layer id in [0, {len(layers)}) per drafter "
            f"layer ({len(mine)})"
        )
    copied = 0
    with torch.no_grad():
        for layer, j in zip(mine, ids):
            theirs = dict(layers[j].named_parameters())
            for name, p in layer.named_parameters():
                src = theirs.get(name)
                if src is not None and src.shape == p.shape:
                    p.copy_(src.to(p.dtype))
                    copied += 1
    if copied == 0:
        raise ValueError("--init-layers-from-target: no tensor of the target's layers matches the drafter's layers")
    return copied


def target_final_norm(target: nn.Module) -> torch.Tensor | None:
    """The weight of the target's final RMSNorm (our MLA or GQA target), if it has one."""
    from dspark.models.layers import DecoderTarget

    if isinstance(target, DecoderTarget):
        return target.model.norm.weight.detach()
    return None


def warm_start_(drafter: DSparkDrafter, source: str | Path, target: nn.Module) -> None:
    """Copy the weights of an earlier run into a fresh drafter (new optimizer and schedule): ``source`` is that
    run's out_dir, its ``last.pt`` or an exported drafter dir. The drafter configs must be equal except for the
    position keys (a drafter for a YaRN-extended target starts from the short-context one)."""
    from dspark.models.loading import load_drafter

    src = Path(source)
    ckpt = checkpoint_path(src) if src.is_dir() and checkpoint_path(src).is_file() else src
    if ckpt.is_file():
        blob = torch.load(ckpt, map_location="cpu", weights_only=True)
        if "trainer" not in blob or "draft_config" not in blob:
            raise ValueError(f"--init-from {ckpt}: not a train-draft checkpoint (no trainer/draft_config entries)")
        theirs, state = blob["draft_config"], blob["trainer"]["model"]
    elif (src / "config.json").is_file():
        loaded = load_drafter(src, target)
        theirs, state = loaded.config.to_dict(), loaded.state_dict()
    else:
        raise FileNotFoundError(
            f"--init-from {src}: neither a run dir with checkpoint/last.pt, a .pt checkpoint, nor a drafter export "
            "dir with config.json"
        )
    ours = drafter.config.to_dict()
    diffs = [
        f"{k}: {theirs.get(k)!r} there vs {v!r} here"
        for k, v in ours.items()
        if theirs.get(k) != v and k not in POSITION_KEYS
    ]
    if diffs:
        raise ValueError(f"--init-from {src}: a different drafter ({'; '.join(diffs)}); use the same shape flags")
    with torch.no_grad():
        drafter.load_state_dict({k: v.float() for k, v in state.items()})
