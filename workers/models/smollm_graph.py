"""The graph SmolLM2 is exported as: one forward over any mix of prefill and decode with an
explicit KV cache (its inputs and outputs: ``workers.models.smollm``). Attention is written
here over the Hugging Face module's weights, so the (past_kv -> new_kv) interface exports
cleanly, where the library's cache objects do not."""

from __future__ import annotations

from typing import Any


def KVDecoder(model: Any) -> Any:  # noqa: N802 - builds a torch module class lazily
    """``model`` (a transformers Llama) as (input_ids, attention_mask, position_ids, past_kv)
    -> (logits, new_kv); see the module docstring. Defined in a function so importing this
    module needs no torch."""
    import torch

    class _KVDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = model.config
            self.inner = model.model
            self.lm_head = model.lm_head
            self.heads = cfg.num_attention_heads
            self.kv_heads = cfg.num_key_value_heads
            self.head_dim = cfg.head_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)

        def forward(self, input_ids, attention_mask, position_ids, past_kv):  # type: ignore[no-untyped-def]
            b, t = input_ids.shape
            p = past_kv.shape[4]
            x = self.inner.embed_tokens(input_ids)
            freqs = position_ids[..., None].to(torch.float32) * self.inv_freq  # [b, t, d/2]
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [b, 1, t, d]
            # Key j is visible to new token i when j <= p + i (causal) and j is not padding.
            keys = torch.arange(p + t, device=input_ids.device)
            causal = keys[None, :] <= (torch.arange(t, device=input_ids.device)[:, None] + p)
            visible = causal[None, None] & (attention_mask[:, None, None, :] > 0)
            bias = torch.where(visible, 0.0, torch.finfo(torch.float32).min)  # [b, 1, t, p+t]
            scale = self.head_dim ** -0.5
            new_kv = []
            for i, layer in enumerate(self.inner.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                k = attn.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
                v = attn.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                new_kv.append(torch.stack([k, v]))
                k_all = torch.cat([past_kv[i, 0], k], dim=2)
                v_all = torch.cat([past_kv[i, 1], v], dim=2)
                group = self.heads // self.kv_heads
                k_all = k_all.repeat_interleave(group, dim=1)
                v_all = v_all.repeat_interleave(group, dim=1)
                scores = torch.matmul(q, k_all.transpose(2, 3)) * scale + bias
                probs = torch.softmax(scores, dim=-1)
                out = torch.matmul(probs, v_all).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
                x = x + attn.o_proj(out)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            last = self.inner.norm(x[:, -1])
            return self.lm_head(last), torch.stack(new_kv)

    def _rotate_half(x):  # type: ignore[no-untyped-def]
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return _KVDecoder()
