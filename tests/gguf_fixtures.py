"""Tiny GGUF files written with the `gguf` package's own writer, from tiny random transformers models.

The writer side is an independent re-statement of llama.cpp's converter: HF names -> llama.cpp names, and for the
`llama` architecture q/k rows reordered from rotate-half halves to interleaved rotary pairs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e"]

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 byte values (printable bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Specials (ids 0..2), the 256 byte tokens, then one token per merge; token types (3 = control, 1 = normal)."""
    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


VOCAB_SIZE = len(tiny_vocab()[0])  # 267


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, idx, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{idx}.{_LAYER[module]}.{kind}"


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved pairs, per head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model: torch.nn.Module, arch: str, *, add_bos: bool = False, qtypes=None) -> Path:
    """Write ``model`` (a transformers Llama/Qwen2/Qwen3 causal LM) as a GGUF file of architecture ``arch``.

    ``qtypes`` maps llama.cpp tensor names to a GGMLQuantizationType to quantize with gguf's own quantizer.
    """
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    tokens, types = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    qtypes = qtypes or {}
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        name = gguf_name(hf)
        if arch == "llama" and ".attn_q." in name:
            a = permute_rotary(a, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            a = permute_rotary(a, c.num_key_value_heads)
        if name in qtypes:
            w.add_tensor(name, gguf.quants.quantize(a, qtypes[name]), raw_dtype=qtypes[name])
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_hf(cls, cfg_cls, **kw):
    """A tiny seeded transformers model of class cls (norms and biases moved off their init values)."""
    torch.manual_seed(0)
    cfg = cfg_cls(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)  # norms away from 1, biases away from 0: a wrong map shows
    return model
