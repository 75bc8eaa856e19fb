"""The varlen attention kernel against one causal sdpa call per sample, values and gradients."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.trainer.attention import varlen_kwargs, varlen_sdpa_attention


class _Module(torch.nn.Module):
    is_causal = True


def _per_sample(q, k, v, seq_lens, scale):
    outs, start = [], 0
    groups = q.shape[1] // k.shape[1]
    for n in seq_lens:
        sl = slice(start, start + n)
        kk = k[:, :, sl].repeat_interleave(groups, dim=1)
        vv = v[:, :, sl].repeat_interleave(groups, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, sl], kk, vv, is_causal=True, scale=scale
        )
        outs.append(o.transpose(1, 2))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("seq_lens", [[5, 1, 9, 3], [7], [4, 4, 4]])
def test_varlen_equals_per_sample_attention(seq_lens):
    torch.manual_seed(0)
    t, heads, kv_heads, d = sum(seq_lens), 4, 2, 16
    q = torch.randn(1, heads, t, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, t, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, t, d, dtype=torch.float64, requires_grad=True)
    kwargs = varlen_kwargs(seq_lens, q.device)
    out, _ = varlen_sdpa_attention(_Module(), q, k, v, None, scaling=0.3, **kwargs)
    ref = _per_sample(q, k, v, seq_lens, 0.3)
    assert out.shape == (1, t, heads, d)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_varlen_differs_from_one_dense_causal_row():
    """Control: the same row as one sequence (samples see each other) gives other outputs."""
    torch.manual_seed(1)
    seq_lens = [3, 6]
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    out, _ = varlen_sdpa_attention(_Module(), q, k, v, None, **varlen_kwargs(seq_lens, q.device))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - dense.transpose(1, 2)).abs().max() > 1e-3
    # the first sample is a prefix, so it agrees
    torch.testing.assert_close(out[:, :3], dense.transpose(1, 2)[:, :3])


def test_boundaries_from_position_restarts_without_varlen_kwargs():
    torch.manual_seed(2)
    seq_lens = [4, 2, 5]
    q, k, v = (torch.randn(1, 2, 11, 8) for _ in range(3))
    pos = torch.cat([torch.arange(n) for n in seq_lens]).unsqueeze(0)
    got, _ = varlen_sdpa_attention(_Module(), q, k, v, None, position_ids=pos)
    want, _ = varlen_sdpa_attention(_Module(), q, k, v, None, **varlen_kwargs(seq_lens, q.device))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, _per_sample(q, k, v, seq_lens, None))
