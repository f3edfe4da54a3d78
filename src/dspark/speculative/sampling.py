"""Logit processing (temperature, top-k, top-p) and inverse-CDF sampling, batched.

Semantics follow vLLM. A row with temperature <= GREEDY_EPS is greedy and gets a one-hot argmax of the raw
logits. Otherwise top-k keeps every token whose scaled logit is >= the k-th largest, so ties at the threshold
stay. Top-p then works on the top-k-renormalised distribution and keeps the smallest set of most likely tokens
whose mass is >= top_p, always at least one token. The result is renormalised. Sorting happens only when some
row uses top-p, and then only over the top-k candidates when every sampled row has a top-k. Top-k alone uses
`torch.topk`. (With top-p, exact ties straddling the largest k of the batch may be cut; this is immaterial.)

Sampling is inverse-CDF, one uniform per row: a cumsum in float64 and a searchsorted. It never calls
torch.multinomial, which is about 25x slower on CPU at V=32k.
"""

import torch

GREEDY_EPS = 1e-5  # temperatures at or below this are greedy (vLLM's _SAMPLING_EPS)


def all_greedy(temperature: torch.Tensor) -> bool:
    """Every row at temperature <= GREEDY_EPS (temperature [B]): every distribution is one-hot at the argmax
    (first index on ties), so sampling, draft q and every acceptance rule reduce to argmax matching and no uniform
    needs drawing (counters are keyed by position, so skipping them changes no later draw)."""
    return bool((temperature <= GREEDY_EPS).all())


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> LongTensor [...] argmax (the first index on ties)."""
    return logits.argmax(dim=-1)


def _one_hot(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    """index [...] -> float32 [..., V] one-hot."""
    out = torch.zeros(*index.shape, num_classes, dtype=torch.float32, device=index.device)
    return out.scatter_(-1, index[..., None], 1.0)


def _mask_top_k(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """x [B, T, V] scaled logits; k [B] (0 = off, rows off keep everything). Masks below the k-th largest."""
    B, T, _ = x.shape
    k_max = int(k.max())
    top = x.topk(k_max, dim=-1).values  # [B, T, k_max], descending
    idx = (k - 1).clamp(min=0)[:, None, None].expand(B, T, 1)
    thresh = top.gather(-1, idx)
    thresh = torch.where((k > 0)[:, None, None], thresh, float("-inf"))
    return x.masked_fill(x < thresh, float("-inf"))


def _mask_sorted(sorted_x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """sorted_x [B, T, N] descending scaled logits; k [B] (0 = off); p [B] (1.0 = off) -> masked sorted_x."""
    B, T, _ = sorted_x.shape
    idx = (k - 1).clamp(min=0)[:, None, None].expand(B, T, 1)
    thresh = torch.where((k > 0)[:, None, None], sorted_x.gather(-1, idx), float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < thresh, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumsum in descending order
    drop = mass_before >= p[:, None, None]
    drop[..., 0] = False  # always keep the most likely token
    return sorted_x.masked_fill(drop, float("-inf"))


def _mask_top_k_top_p(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """x [B, T, V] scaled logits; k [B] (0 = off); p [B] (1.0 = off); active [B] rows whose result is used.

    When every active row has a top-k, only the top max(k) candidates are sorted (torch.topk), otherwise
    the whole vocabulary is. Only active rows are sorted (a batch of mostly greedy rows sorts just the others);
    inactive rows come back unmasked.
    """
    if not bool(active.all()):
        rows = active.nonzero().squeeze(1)
        out = x.clone()
        out[rows] = _mask_top_k_top_p(x[rows], k[rows], p[rows], active[rows])
        return out
    if bool((k > 0).all()):
        top, order = x.topk(int(k.max()), dim=-1)  # [B, T, k_max], descending
        out = torch.full_like(x, float("-inf"))
        return out.scatter_(-1, order, _mask_sorted(top, k, p))
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B, T, V]
    return torch.empty_like(x).scatter_(-1, order, _mask_sorted(sorted_x, k, p))


def process_logits(
    logits: torch.Tensor,  # [B, T, V]
    temperature: torch.Tensor,  # [B] float; <= GREEDY_EPS means greedy
    top_k: torch.Tensor,  # [B] int; 0 (or >= V) = off
    top_p: torch.Tensor,  # [B] float; 1.0 = off
) -> torch.Tensor:
    """Sampling distributions [B, T, V] float32 after temperature, top-k and top-p (vLLM order)."""
    if logits.dim() != 3 or not temperature.shape == top_k.shape == top_p.shape == logits.shape[:1]:
        raise ValueError(
            f"process_logits: expected logits [B, T, V] and temperature/top_k/top_p [B], got logits "
            f"{tuple(logits.shape)}, temperature {tuple(temperature.shape)}, top_k {tuple(top_k.shape)}, "
            f"top_p {tuple(top_p.shape)}"
        )
    V = logits.shape[-1]
    x = logits.float()
    is_greedy = temperature <= GREEDY_EPS
    if bool(is_greedy.all()):
        return _one_hot(greedy(x), V)
    temp = torch.where(is_greedy, 1.0, temperature.to(torch.float32))
    x = x / temp[:, None, None]
    k = torch.where((top_k > 0) & (top_k < V) & ~is_greedy, top_k.to(torch.int64), 0)
    p = torch.where(is_greedy, 1.0, top_p.to(torch.float32))
    if bool((p < 1.0).any()):
        x = _mask_top_k_top_p(x, k, p, ~is_greedy)
    elif bool((k > 0).any()):
        x = _mask_top_k(x, k)
    probs = x.softmax(dim=-1)
    if bool(is_greedy.any()):
        probs = torch.where(is_greedy[:, None, None], _one_hot(greedy(logits), V), probs)
    return probs


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row: probs [..., V] (need not be normalised), u [...] in (0, 1) -> LongTensor [...].

    Returns the smallest index whose cumulative mass exceeds u * total. The target is clamped strictly
    below the total, so fp rounding can never run past the last token with nonzero probability, and a
    zero-probability token is never returned. An all-zero row returns V - 1 (the caller's bug).
    """
    lead, V = probs.shape[:-1], probs.shape[-1]
    if u.shape != lead:
        raise ValueError(
            f"sample_inverse_cdf: u must have shape probs.shape[:-1] = {tuple(lead)}, got {tuple(u.shape)}"
        )
    cdf = probs.reshape(-1, V).to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    target = u.reshape(-1, 1).to(torch.float64) * total
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=V - 1)
    return index.reshape(lead)
