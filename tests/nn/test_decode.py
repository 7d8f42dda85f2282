"""Incremental decoding of the nn models with a decode cache: a prefill and then single
tokens or chunks give the full forward's logits, ``generate`` gives the no-cache loop's
tokens, the cache's buffers are written in place, and bad chunks get clear errors."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels.nn import layers as nn_layers
from tests.support import attnres_ops_called, model_variants

VOCAB, D, HEADS, LAYERS = 29, 16, 2, 3

VARIANTS = model_variants()


def make(variant, backend, attention_backend="auto", n_layers=LAYERS):
    """A model whose parameters are moved away from their init (non-uniform depth reads)."""
    cls, kwargs = VARIANTS[variant]
    model = getattr(ak.nn, cls)(
        VOCAB, D, n_layers, HEADS, backend=backend, attention_backend=attention_backend, **kwargs
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def greedy_without_cache(model, idx, max_new_tokens):
    """Greedy decoding by re-running the full forward over the growing sequence."""
    seq = idx
    for _ in range(max_new_tokens):
        next_token = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, next_token], dim=1)
    return seq


@pytest.mark.parametrize("attention_backend", ["auto", "sdpa"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_incremental_logits_equal_full_forward(variant, backend, attention_backend):
    model = make(variant, backend, attention_backend)
    idx = torch.randint(0, VOCAB, (3, 12))
    expected = model(idx)
    cache = model.new_cache(3, 12)
    # A prefill, single tokens, then a chunk of several tokens against the longer cache
    # (bottom-right causal alignment), ending exactly at max_len.
    bounds = [0, 4, 5, 6, 7, 12]
    chunks = []
    for start, end in zip(bounds, bounds[1:]):
        chunks.append(model(idx[:, start:end], cache=cache))
        assert cache.length == end
    torch.testing.assert_close(torch.cat(chunks, dim=1), expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_greedy_generate_equals_loop_without_cache(variant, backend):
    model = make(variant, backend)
    prompt = torch.randint(0, VOCAB, (2, 5))
    tokens = model.generate(prompt, 5)
    assert tokens.shape == (2, 10) and tokens.dtype == prompt.dtype
    assert torch.equal(tokens, greedy_without_cache(model, prompt, 5))


@torch.no_grad()
def test_sampling_follows_the_generator_and_the_logits():
    model = make("Block-two-phase", "cpu")
    prompt = torch.randint(0, VOCAB, (3, 4))
    first = model.generate(prompt, 6, temperature=0.8, generator=torch.Generator().manual_seed(7))
    again = model.generate(prompt, 6, temperature=0.8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, again)
    # The same draws from a no-cache loop (the C++ kernels give the cached and the full
    # forward's logits bit for bit, so the probabilities match exactly).
    generator, seq = torch.Generator().manual_seed(7), prompt
    for _ in range(6):
        probs = torch.softmax(model(seq)[:, -1].float() / 0.8, dim=-1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=generator)], dim=1)
    assert torch.equal(first, seq)
    assert not torch.equal(first, model.generate(prompt, 6)), "sampling at 0.8 gave the greedy tokens"


@pytest.mark.parametrize("variant", ["Standard", "Block-two-phase"])
@torch.no_grad()
def test_cache_is_written_in_place(variant, monkeypatch):
    """The attention reads views of the preallocated buffers; nothing is reallocated per step."""
    model = make(variant, "cpu")
    cache = model.new_cache(2, 9)
    keys, values = cache.keys, cache.values
    pointers = (keys.data_ptr(), values.data_ptr())
    attended = []
    original = nn_layers.CausalSelfAttention.attend

    def spy(self, q, k, v):
        attended.append((k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr(), k.shape[2]))
        return original(self, q, k, v)

    monkeypatch.setattr(nn_layers.CausalSelfAttention, "attend", spy)
    idx = torch.randint(0, VOCAB, (2, 9))
    model(idx[:, :6], cache=cache)
    for t in range(6, 9):
        model(idx[:, t : t + 1], cache=cache)
        assert cache.keys is keys and cache.values is values
        assert (keys.data_ptr(), values.data_ptr()) == pointers
    assert len(attended) == 4 * LAYERS
    assert all(a[:2] == pointers for a in attended)
    assert [a[2] for a in attended[::LAYERS]] == [6, 7, 8, 9]
    # Position 8's keys were written (the buffers start zeroed).
    assert keys[:, :, :, 8].abs().amax() > 0


@torch.no_grad()
def test_cpu_decode_step_runs_the_fused_kernels():
    model = make("Full-chunked", "cpu")
    cache = model.new_cache(2, 6)
    idx = torch.randint(0, VOCAB, (2, 6))
    model(idx[:, :5], cache=cache)
    called = attnres_ops_called(lambda: model(idx[:, 5:], cache=cache))
    assert "attnres::attn_fwd" in called and "attnres::depth_attn_fwd" in called, called
    assert "attnres::attn_fwd_decode" in called, called  # one query per head: the C++ decode path


@torch.no_grad()
def test_bad_chunks_raise_clear_errors_and_leave_the_cache_unchanged():
    model = make("Full", "cpu")
    cache = model.new_cache(2, 5)
    idx = torch.randint(0, VOCAB, (2, 5))
    model(idx[:, :4], cache=cache)
    with pytest.raises(ValueError, match="max_len = 5"):
        model(idx[:, :2], cache=cache)
    with pytest.raises(ValueError, match="batch size 3 but the cache was made for 2"):
        model(torch.randint(0, VOCAB, (3, 1)), cache=cache)
    with pytest.raises(ValueError, match=r"\[batch, T\]"):
        model(idx[:, :0], cache=cache)
    other = make("Full", "cpu", n_layers=LAYERS + 1)
    with pytest.raises(ValueError, match="this model's new_cache"):
        other(idx[:, :1], cache=cache)
    with pytest.raises(TypeError, match="dtype=torch.float32"):
        model(idx[:, 4:], cache=model.new_cache(2, 5, dtype=torch.float64))
    assert cache.length == 4
    model(idx[:, 4:], cache=cache)  # the last position still fits
    assert cache.length == 5
    cache.reset()
    torch.testing.assert_close(model(idx, cache=cache), model(idx), rtol=1e-5, atol=2e-5)


def test_generate_rejects_bad_arguments():
    model = make("Standard", "cpu")
    prompt = torch.randint(0, VOCAB, (1, 3))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match="prompt"):
        model.generate(prompt[0], 2)
    assert torch.equal(model.generate(prompt, 0), prompt)


@torch.no_grad()
def test_decode_under_autocast_uses_a_cache_of_the_autocast_dtype():
    model = make("Block-two-phase", "cpu")
    idx = torch.randint(0, VOCAB, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(idx).float()
        cache = model.new_cache(2, 7)
        assert cache.keys.dtype == torch.bfloat16
        logits = torch.cat(
            [model(idx[:, :5], cache=cache), model(idx[:, 5:6], cache=cache), model(idx[:, 6:], cache=cache)], 1
        )
        assert model.generate(idx[:, :3], 2).shape == (2, 5)
    # bf16 rounds to 0.4 % per op: the cached path may round differently from the full forward.
    assert ((logits.float() - expected).norm() / expected.norm()).item() < 2e-2
