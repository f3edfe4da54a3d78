"""The DSpark drafter: visibility, cache invariant, Markov head paths, official format round trips."""

import json

import pytest
import torch

from dspark.cache.pool import PagedPool
from dspark.checkpoint.roster import num_params
from dspark.config import DraftConfig, read_json
from dspark.llm import OFFICIAL_DRAFT_CONFIG
from dspark.models.drafter import DSparkDrafter, block_mask
from dspark.models.heads import MarkovHead
from dspark.models.loading import draft_roster, load_drafter, load_target, save_drafter, save_target
from dspark.models.tiny import build_tiny_pair, randomize_, tiny_draft_config, tiny_target_config
from dspark.train.anchors import block_visibility

OFFICIAL = OFFICIAL_DRAFT_CONFIG
K = 7


def test_block_mask_sees_context_before_anchor_and_whole_block():
    m = block_mask(torch.tensor([5, 9]), K, 20)
    for b, p in enumerate([5, 9]):
        for k in range(K):
            assert m[b, k].nonzero().flatten().tolist() == list(range(p + K))


def test_training_visibility_matches_inference_mask():
    S = 24
    anchors = torch.tensor([[4, 10]])
    keep = torch.tensor([[True, True]])
    vis = block_visibility(S, anchors, keep, K)  # [1, 2K, S + 2K]
    for a_idx, a in enumerate([4, 10]):
        rows = vis[0, a_idx * K : (a_idx + 1) * K]
        ctx = rows[:, :S]
        blk = rows[:, S:]
        assert ctx.nonzero()[:, 1].unique().tolist() == list(range(a))
        own = torch.zeros(2 * K, dtype=torch.bool)
        own[a_idx * K : (a_idx + 1) * K] = True
        assert (blk == own).all()


def _taps(target, drafter, ids):
    with torch.no_grad():
        return target(ids, tap_layers=drafter.config.target_layer_ids, compute_logits=False).taps


def _draft_paged(drafter, pool, table, ctx_taps, ctx_pos, anchor_tok, p):
    page = pool.page_size
    slot = lambda pos: table[pos // page] * page + pos % page  # noqa: E731
    block_pos = torch.arange(p, p + K)[None]
    write = torch.tensor([[slot(int(q)) for q in ctx_pos[0]] + [slot(int(q)) for q in block_pos[0]]])
    read = torch.tensor([[slot(q) for q in range(p + K)]])
    store = pool.view(write, read, 0)
    block = torch.tensor([[anchor_tok] + [drafter.config.mask_token_id] * (K - 1)])
    with torch.no_grad():
        return drafter(block, block_pos, block_mask(torch.tensor([p]), K, p + K), ctx_taps, ctx_pos, store)


@pytest.mark.parametrize("absorbed", [True, False])
def test_incremental_context_equals_all_at_once(absorbed):
    target, drafter = build_tiny_pair(3)
    ids = torch.randint(4, 96, (1, 14), generator=torch.Generator().manual_seed(0))
    taps = _taps(target, drafter, ids)
    n = 12
    lat = drafter.latent_dim
    # (a) everything at once, no store (training path): context rows first, then the block
    block = torch.tensor([[int(ids[0, n])] + [3] * (K - 1)])
    mask_a = torch.cat((torch.arange(n)[None, None, :].expand(1, K, n) < n, torch.ones(1, K, K, dtype=torch.bool)), -1)
    with torch.no_grad():
        ref = drafter(block, torch.arange(n, n + K)[None], mask_a, taps[:, :n], torch.arange(n)[None], None, absorbed)
    # (b) paged pool, context fed in three increments with a draft after each (shuffled page table)
    pool = PagedPool(drafter.config.num_hidden_layers, 8, 4, lat, torch.float32)
    table = [5, 2, 7, 0, 3, 1]
    for lo, hi in [(0, 5), (5, 9), (9, n)]:
        out = _draft_paged(drafter, pool, table, taps[:, lo:hi], torch.arange(lo, hi)[None], int(ids[0, hi]), hi)
    torch.testing.assert_close(out.base_logits, ref.base_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden, ref.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_serial_markov_with_forced_tokens_equals_teacher_forced(head_type):
    torch.manual_seed(0)
    head = MarkovHead(50, 8, 16, head_type)
    randomize_(head, 1, 0.3)
    base = torch.randn(3, K, 50)
    hidden = torch.randn(3, K, 16)
    gt = torch.randint(0, 50, (3, K))
    anchor = torch.randint(0, 50, (3,))
    prev = torch.cat((anchor[:, None], gt[:, :-1]), 1)
    tf_logits, tf_emb = head.teacher_forced(base, hidden, prev)
    sample = head.sample(base, hidden, anchor, lambda logits, k: gt[:, k])
    torch.testing.assert_close(sample.logits, tf_logits)
    torch.testing.assert_close(sample.prev_embeds, tf_emb)
    assert torch.equal(sample.tokens, gt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduced", [False, True])
def test_native_greedy_markov_loop_picks_the_serial_loops_drafts(dtype, reduced):
    """markov_greedy (one native call) against the serial Python loop with argmax picks: the same drafts in fp32;
    in bf16 (the correction rounded to W2's dtype, summed in another order) every draft's corrected logit is within
    one bf16 step of the slot's maximum. A reduced vocabulary maps indices to target ids."""
    from dspark import native

    if native.ops() is None:
        pytest.skip(f"native kernels: {native.status()}")
    torch.manual_seed(0)
    V, r, B, Kd = 300, 16, 5, 6
    head = MarkovHead(V, r, 16, "vanilla")
    randomize_(head, 1, 0.5)
    head.to(dtype)
    ids = torch.randperm(V)[:120] if reduced else None
    w2 = None
    if reduced:
        from dspark.speculative.draft_vocab import _rows

        w2 = _rows(head.markov_w2.weight, ids)
    N = V if ids is None else ids.shape[0]
    base = torch.randn(B, Kd, N) * 3
    anchor = torch.randint(0, V, (B,))
    picks = []

    def pick(corrected, k):
        index = corrected.argmax(-1)
        picks.append(corrected)
        return index if ids is None else ids[index]

    with torch.inference_mode():
        got = head.greedy_tokens(base, anchor, w2, ids)
        ref = head.sample(base, torch.zeros(B, Kd, 16, dtype=dtype), anchor, pick, None, w2).tokens
    assert got is not None and got.shape == (B, Kd)
    if dtype == torch.float32:
        assert torch.equal(got, ref)
    else:  # the first slot's correction reads the same W1 row in both: the chosen logit is (near) the maximum
        corrected = picks[0]
        index = got[:, 0] if ids is None else torch.tensor([ids.tolist().index(t) for t in got[:, 0].tolist()])
        chosen = corrected.gather(1, index[:, None])[:, 0]
        assert bool((corrected.max(-1).values - chosen <= corrected.abs().max() * 2**-7).all())
    head.head_type = "gated"
    assert head.greedy_tokens(base, anchor, w2, ids) is None  # other heads keep the serial loop


def test_markov_topk_restricts_q_to_base_candidates():
    torch.manual_seed(0)
    head = MarkovHead(50, 8, 16)
    randomize_(head, 1, 0.3)
    base = torch.randn(2, K, 50)
    s = head.sample(base, torch.randn(2, K, 16), torch.tensor([1, 2]), lambda x, k: x.argmax(-1), topk=5)
    finite = torch.isfinite(s.logits)
    assert (finite.sum(-1) == 5).all()
    top = base.topk(5, -1).indices
    assert finite.gather(-1, top).all()


def test_markov_rank_zero_is_pure_dflash():
    tcfg = tiny_target_config()
    target, with_head = build_tiny_pair(0)
    plain = DSparkDrafter(tiny_draft_config(tcfg, markov_rank=0, confidence=False))
    state = {k: v for k, v in with_head.state_dict().items() if not k.startswith(("markov_head", "confidence_head"))}
    plain.load_state_dict(state, strict=True)
    plain.attach(target.embed_tokens, target.lm_head)
    assert plain.markov_head is None and plain.confidence_head is None
    ids = torch.randint(4, 96, (1, 8))
    taps = _taps(target, plain, ids)
    block = torch.tensor([[5] + [3] * (K - 1)])
    mask = torch.ones(1, K, 8 + K, dtype=torch.bool)
    with torch.no_grad():
        a = plain(block, torch.arange(8, 8 + K)[None], mask, taps, torch.arange(8)[None])
        b = with_head(block, torch.arange(8, 8 + K)[None], mask, taps, torch.arange(8)[None])
    torch.testing.assert_close(a.base_logits, b.base_logits)  # the backbone is untouched by the heads


def test_official_roster():
    cfg = DraftConfig.from_dict(read_json(OFFICIAL))
    roster = draft_roster(cfg)
    assert len(roster) == 68
    assert num_params(roster) == 3_562_312_961
    assert roster["context_proj.weight"].shape == (7168, 35840)
    assert roster["layers.4.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert roster["layers.0.self_attn.kv_b_proj.weight"].shape == (16384, 512)
    assert roster["markov_head.markov_w2.weight"].shape == (163840, 256)
    assert roster["confidence_head.proj.weight"].shape == (1, 7424)
    assert roster["confidence_head.proj.bias"].shape == (1,)


def test_k3_format_round_trip(tmp_path):
    target, drafter = build_tiny_pair(1)
    save_target(target, tmp_path / "t")
    save_drafter(drafter, tmp_path / "d", dtype="float32")
    t2 = load_target(tmp_path / "t")
    d2 = load_drafter(tmp_path / "d", t2)
    for (n1, p1), (n2, p2) in zip(drafter.state_dict().items(), d2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["model_type"] == "k3_dspark" and cfg["architectures"] == ["K3DSparkModel"]


def _qwen3_draft_config(hidden: int, vocab: int, layers: int) -> dict:
    return {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": vocab,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "num_target_layers": layers,
        "block_size": 7,
        "target_layer_ids": [0, 2],
        "mask_token_id": 3,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
    }


def test_deepspec_qwen3_format_round_trip(tmp_path):
    target, _ = build_tiny_pair(2)
    cfg = DraftConfig.from_dict(_qwen3_draft_config(32, 96, 4))
    assert cfg.is_gqa and not cfg.rope.interleave and cfg.target_num_hidden_layers == 4
    drafter = DSparkDrafter(cfg)
    randomize_(drafter, 5)
    drafter.attach(target.embed_tokens, target.lm_head)
    save_drafter(drafter, tmp_path / "q", dtype="float32")
    from dspark.checkpoint.io import list_checkpoint_tensors

    names = set(list_checkpoint_tensors(tmp_path / "q"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= names
    assert not any(n.startswith(("context_proj", "final_norm")) for n in names)
    d2 = load_drafter(tmp_path / "q", target)
    ids = torch.randint(4, 96, (1, 6))
    taps = _taps(target, d2, ids)
    mask = torch.ones(1, K, 6 + K, dtype=torch.bool)
    block = torch.tensor([[5] + [3] * (K - 1)])
    with torch.no_grad():
        a = drafter(block, torch.arange(6, 6 + K)[None], mask, taps, torch.arange(6)[None])
        b = d2(block, torch.arange(6, 6 + K)[None], mask, taps, torch.arange(6)[None])
    torch.testing.assert_close(a.base_logits, b.base_logits)
