"""attnres_kernels.hf on transformers' Inkling2: patched vs unpatched models.

Every model here is a tiny random Inkling2 (both layer types, several blocks, a few experts,
random non-zero AttnRes queries so the depth softmax is not uniform) saved to and loaded back
from a temporary directory, like a hub checkpoint. Each test compares a patched model with an
unpatched one loaded from the same files.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers  # requirements-dev.txt pins it: these tests run in CI, never skipped
from transformers.models.inkling2 import modeling_inkling2 as hf_inkling2

import attnres_kernels as ak
from attnres_kernels import hf
from attnres_kernels.hf import inkling2

FWD_OP = "attnres::depth_attn_fwd"
BWD_OP = "attnres::depth_attn_bwd"
T = 12  # > sliding window (4) and > rel_extent (6)


def text_config(**overrides):
    """5 layers (sliding, full, sliding, sliding, full), blocks of 2: reads over 1 to 3 blocks + the partial."""
    kw = dict(
        vocab_size=96,
        unpadded_vocab_size=90,
        hidden_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=8,
        sliding_window_size=4,
        d_rel=4,
        rel_extent=6,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"],
        n_layers_per_attn_res_block=2,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    kw.update(overrides)
    return transformers.Inkling2TextConfig(**kw)


def randomize(model, seed=0):
    """Non-zero AttnRes queries (zero-initialised in transformers: every read would be a plain mean)
    and non-trivial norm weights, so a wrong logit, value or output norm changes the result."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.copy_(1.5 * torch.randn(p.shape, generator=gen))
            elif "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Inkling2ForCausalLM saved in fp32."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("inkling2")
    randomize(transformers.Inkling2ForCausalLM(text_config())).save_pretrained(path)
    return path


def load(path, patched: bool, dtype=torch.float32, **patch_kwargs):
    model = transformers.Inkling2ForCausalLM.from_pretrained(path, dtype=dtype)
    if patched:
        assert hf.apply_attnres_kernels(model, **patch_kwargs) is model
    return model


def batch(seed=1, b=2, t=T):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 90, (b, t), generator=gen)


def ops_run(fn):
    """The attnres ops run by ``fn()``, once per call (the profiler can also show an op's redispatch to its
    kernel as a nested event of the same name, e.g. when checkpointing recomputes it in the backward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [
        e.name
        for e in prof.events()
        if e.name.startswith("attnres") and (e.cpu_parent is None or e.cpu_parent.name != e.name)
    ]


def loss_and_grads(model, ids, params_of=None):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out, {n: p.grad for n, p in (params_of or model).named_parameters()}


def assert_close(actual, expected, what, rtol=1e-4, atol=1e-5):
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * (1 + scale), msg=lambda m: f"{what}: {m}")


N_READS = 2 * 5 - 1 + 1  # two per layer, none before layer 0's attention, one output read


# ---------------------------------------------------------------- the module


@pytest.mark.parametrize("n_blocks", [0, 1, 3])
@pytest.mark.parametrize("num_queries", [1, 3])
def test_module_read_matches_eager(n_blocks, num_queries):
    """One patched Inkling2BlockAttentionResidual: outputs (values, dtypes, count) and gradients of the
    query, bf16 block states and fp32 partial (as in the MLP read of a bf16 model) equal the eager module's."""
    torch.manual_seed(n_blocks)
    eager = hf_inkling2.Inkling2BlockAttentionResidual(text_config(), num_queries=num_queries)
    with torch.no_grad():
        eager.query.normal_(0, 1.5)
    fused = hf_inkling2.Inkling2BlockAttentionResidual(text_config(), num_queries=num_queries)
    fused.load_state_dict(eager.state_dict())
    hf.apply_attnres_kernels(fused)
    assert type(fused) is inkling2.AttnResKernelsBlockAttentionResidual
    assert fused.state_dict().keys() == eager.state_dict().keys()

    blocks = (3 * torch.randn(2, 5, n_blocks, 32)).bfloat16()
    partial = torch.randn(2, 5, 32)
    results = []
    for module in (eager, fused):
        b, p = blocks.clone().requires_grad_(), partial.clone().requires_grad_()
        outs = module(b, p)
        sum(((i + 1) * o * torch.linspace(-1, 1, 32)).sum() for i, o in enumerate(outs)).backward()
        results.append((outs, b.grad, p.grad, module.query.grad))
    (outs_e, *grads_e), (outs_f, *grads_f) = results
    assert isinstance(outs_f, tuple) and len(outs_f) == len(outs_e) == num_queries
    for o_f, o_e in zip(outs_f, outs_e):
        assert o_f.dtype == o_e.dtype == torch.float32 and o_f.shape == o_e.shape
        assert_close(o_f, o_e, "output")
    if n_blocks == 0:  # the eager cat hands an empty block stack an empty gradient; unbind hands it none
        grads_f[0] = torch.zeros_like(blocks)
    for g_f, g_e, what in zip(grads_f, grads_e, ("block_states", "partial", "query")):
        assert g_f.dtype == g_e.dtype, what
        if what == "block_states":  # bf16 gradients: one rounding of the same fp32 value
            assert_close(g_f.float(), g_e.float(), what, rtol=1e-2, atol=1e-2)
        else:
            assert_close(g_f, g_e, what)


def test_module_read_compiles_without_graph_breaks():
    module = hf.apply_attnres_kernels(hf_inkling2.Inkling2BlockAttentionResidual(text_config(), num_queries=3))
    with torch.no_grad():
        module.query.normal_()
    blocks, partial = torch.randn(2, 4, 2, 32), torch.randn(2, 4, 32)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for o_c, o in zip(compiled(blocks, partial), module(blocks, partial)):
        assert_close(o_c, o, "compiled read")


# ---------------------------------------------------------------- fp32 models


@pytest.mark.parametrize("fuse_norms", [True, False])
def test_fp32_logits_loss_grads_and_generate(checkpoint, fuse_norms):
    """From the same checkpoint: logits, loss, every parameter gradient and greedy tokens (with the cache)
    of the patched model equal the unpatched model's; the fused C++ op ran every read; state dict untouched."""
    eager, fused = load(checkpoint, False), load(checkpoint, True, fuse_norms=fuse_norms)
    reads = [m for m in fused.modules() if isinstance(m, hf_inkling2.Inkling2BlockAttentionResidual)]
    assert len(reads) == N_READS and all(type(m) is inkling2.AttnResKernelsBlockAttentionResidual for m in reads)
    layers = {type(layer).__name__ for layer in fused.model.layers}
    if fuse_norms:
        assert layers == {"AttnResKernelsSlidingDecoderLayer", "AttnResKernelsFullDecoderLayer"}
    else:
        assert layers == {"Inkling2SlidingDecoderLayer", "Inkling2FullDecoderLayer"}
    sd_e, sd_f = eager.state_dict(), fused.state_dict()
    assert list(sd_e) == list(sd_f) and all(torch.equal(sd_e[k], sd_f[k]) for k in sd_e)

    ids = batch()
    out_e, grads_e = loss_and_grads(eager, ids)
    ran = ops_run(lambda: loss_and_grads(fused, ids))
    out_f, grads_f = loss_and_grads(fused, ids)
    assert ran.count(FWD_OP) == N_READS, ran
    assert_close(out_f.logits, out_e.logits, "logits")
    assert_close(out_f.loss, out_e.loss, "loss")
    assert grads_f.keys() == grads_e.keys()
    for name, g in grads_e.items():
        assert g is not None and grads_f[name] is not None, name
        assert_close(grads_f[name], g, f"grad of {name}", atol=2e-5)

    prompt = batch(seed=2, t=5)
    with torch.no_grad():
        tokens_e = eager.generate(prompt, max_new_tokens=8, do_sample=False)
        ran = ops_run(lambda: fused.generate(prompt, max_new_tokens=2, do_sample=False))
        tokens_f = fused.generate(prompt, max_new_tokens=8, do_sample=False)
    assert ran.count(FWD_OP) == 2 * N_READS  # prefill + one cached decode step (the second token)
    assert torch.equal(tokens_f, tokens_e)


def test_a_wrong_read_is_caught(checkpoint, monkeypatch):
    """The comparisons above can fail: a read that skips the value normalisation changes the logits."""
    eager, fused = load(checkpoint, False), load(checkpoint, True)
    real = inkling2.depth_attention
    monkeypatch.setattr(inkling2, "depth_attention", lambda *a, **k: real(*a, **{**k, "normalize_values": False}))
    ids = batch()
    with torch.no_grad():
        diff = (fused(ids).logits - eager(ids).logits).abs().max().item()
    assert diff > 1e-2


@pytest.mark.parametrize("fuse_norms", [True, False])
def test_gradient_checkpointing(checkpoint, fuse_norms):
    """With gradient checkpointing the patched reads run again in the backward; loss and gradients
    equal the unpatched model's without checkpointing."""
    eager, fused = load(checkpoint, False), load(checkpoint, True, fuse_norms=fuse_norms)
    fused.gradient_checkpointing_enable()
    eager.train(), fused.train()
    ids = batch()
    out_e, grads_e = loss_and_grads(eager, ids)
    calls = []
    for module in fused.modules():
        if isinstance(module, hf_inkling2.Inkling2BlockAttentionResidual):
            module.register_forward_hook(lambda *args: calls.append(1))
    ran = ops_run(lambda: loss_and_grads(fused, ids))
    # each layer's reads once more in the backward (not the output read: it is outside the layers)
    assert ran.count(BWD_OP) == N_READS and ran.count(FWD_OP) == N_READS + (N_READS - 1)
    if not fuse_norms:  # through the read modules' own forward
        assert len(calls) == N_READS + (N_READS - 1)
    out_f, grads_f = loss_and_grads(fused, ids)
    assert_close(out_f.loss, out_e.loss, "loss")
    for name, g in grads_e.items():
        assert_close(grads_f[name], g, f"grad of {name}", atol=2e-5)


def test_torch_compile(checkpoint):
    """torch.compile of the patched model (aot_eager, to keep CI fast) runs as one graph, no graph break; it
    calls the fused op for every read; logits and gradients equal the unpatched model's."""
    from torch._dynamo.utils import counters

    eager, fused = load(checkpoint, False), load(checkpoint, True)
    compiled = torch.compile(fused, backend="aot_eager")
    ids = batch()
    out_e, grads_e = loss_and_grads(eager, ids)
    counters.clear()
    out_c, grads_c = loss_and_grads(compiled, ids, params_of=fused)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_close(out_c.logits, out_e.logits, "logits")
    for name, g in grads_e.items():
        assert_close(grads_c[name], g, f"grad of {name}", atol=2e-5)
    # (the call already compiled: a new signature would be traced, with fake tensors, under the profiler)
    assert ops_run(lambda: compiled(ids, labels=ids)).count(FWD_OP) == N_READS


def test_trainer(checkpoint, tmp_path):
    """transformers.Trainer, 3 SGD steps: the same losses and final parameters as the unpatched model
    (SGD, not Adam, whose normalised update turns round-off in a near-zero gradient into an lr-sized step)."""
    data = [{"input_ids": ids, "labels": ids} for ids in batch(seed=3, b=6)]
    results = []
    for patched in (False, True):
        model = load(checkpoint, patched)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"run{int(patched)}"),
            max_steps=3,
            per_device_train_batch_size=2,
            learning_rate=0.1,
            optim="sgd",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 3
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (losses_e, params_e), (losses_f, params_f) = results
    assert losses_f == pytest.approx(losses_e, rel=1e-4)
    for name, p in params_e.items():
        assert_close(params_f[name], p, name, atol=1e-4)


# ---------------------------------------------------------------- bf16


def test_bf16_checkpoint_then_patch(checkpoint, tmp_path):
    """A bf16 checkpoint loaded in bf16 (AttnRes queries kept in fp32 by transformers), then patched:
    its logits' error against the fp32 model is no larger than the unpatched bf16 model's."""
    load(checkpoint, False, dtype=torch.bfloat16).save_pretrained(tmp_path)
    eager16, fused16 = load(tmp_path, False, dtype=torch.bfloat16), load(tmp_path, True, dtype=torch.bfloat16)
    assert fused16.model.layers[1].attention_input.query.dtype == torch.float32
    assert fused16.model.layers[1].mlp.experts.down_proj.dtype == torch.bfloat16
    reference = load(checkpoint, False)
    ids = batch()
    with torch.no_grad():
        ref = reference(ids).logits.double()
        err_e = (eager16(ids).logits.double() - ref).abs()
        ran = ops_run(lambda: fused16(ids))
        err_f = (fused16(ids).logits.double() - ref).abs()
    assert ran.count(FWD_OP) == N_READS
    assert err_e.max() > 0  # bf16 rounding is visible
    assert err_f.max() <= 1.25 * err_e.max() + 1e-3, (err_f.max(), err_e.max())
    assert err_f.mean() <= 1.25 * err_e.mean() + 1e-4, (err_f.mean(), err_e.mean())


# ---------------------------------------------------------------- other models, backends, errors


def test_conditional_generation_model(tmp_path):
    """Inkling2ForConditionalGeneration (text + vision towers), first layer full-attention, blocks of 3:
    every read patched, text logits equal."""
    text = text_config(
        num_hidden_layers=4, layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"]
    ).to_dict()
    text["n_layers_per_attn_res_block"] = 3
    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=4,
        posemb_grid_size=4,
        projection_hidden_dim=16,
        text_hidden_size=32,
    )
    config = transformers.Inkling2Config(text_config=text, vision_config=vision, image_token_id=91)
    torch.manual_seed(0)
    randomize(transformers.Inkling2ForConditionalGeneration(config)).save_pretrained(tmp_path)
    eager = transformers.Inkling2ForConditionalGeneration.from_pretrained(tmp_path)
    fused = hf.apply_attnres_kernels(transformers.Inkling2ForConditionalGeneration.from_pretrained(tmp_path))
    assert sum(type(m) is inkling2.AttnResKernelsBlockAttentionResidual for m in fused.modules()) == 2 * 4 - 1 + 1
    ids = batch()
    with torch.no_grad():
        assert_close(fused(input_ids=ids).logits, eager(input_ids=ids).logits, "logits")


def test_text_model_and_backends(checkpoint):
    """The bare Inkling2TextModel can be patched too; backend="reference" runs no fused op, and calling
    apply again switches the backend."""
    base = transformers.Inkling2ForCausalLM.from_pretrained(checkpoint).model
    expected = base(batch()).last_hidden_state
    hf.apply_attnres_kernels(base, backend="reference")
    assert ops_run(lambda: base(batch())) == []
    assert_close(base(batch()).last_hidden_state, expected, "hidden states")
    hf.apply_attnres_kernels(base, backend="cpu")
    assert ops_run(lambda: base(batch())).count(FWD_OP) == N_READS


@pytest.mark.parametrize("fuse_norms", [True, False])
def test_cuda_kernels_under_the_simt_harness(tmp_path, monkeypatch, fuse_norms):
    """backend="cuda": the CUDA kernels (run on CPU by the SIMT harness) serve every read of the patched
    model, normalised values included; loss and every gradient equal the unpatched model's. The model's
    RMSNorm eps is large (0.1, the key norm's stays 1e-6), so an output norm with the wrong eps would show."""
    from attnres_kernels.cuda import emulation

    monkeypatch.setenv(emulation.ENV, "1")
    reason = emulation.load()
    assert reason is None, reason
    torch.manual_seed(0)
    randomize(transformers.Inkling2ForCausalLM(text_config(rms_norm_eps=0.1))).save_pretrained(tmp_path)
    eager, fused = load(tmp_path, False), load(tmp_path, True, backend="cuda", fuse_norms=fuse_norms)
    ids = batch()
    out_e, grads_e = loss_and_grads(eager, ids)
    ran = ops_run(lambda: loss_and_grads(fused, ids))
    assert ran.count("attnres_emu::depth_attn_fwd") == N_READS and ran.count(FWD_OP) == 0, ran
    out_f, grads_f = loss_and_grads(fused, ids)
    assert_close(out_f.loss, out_e.loss, "loss")
    for name, g in grads_e.items():
        assert_close(grads_f[name], g, f"grad of {name}", atol=2e-5)


def test_no_attnres_modules():
    with pytest.raises(ValueError, match="no Inkling2BlockAttentionResidual"):
        hf.apply_attnres_kernels(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="unknown backend"):
        hf.apply_attnres_kernels(transformers.Inkling2TextModel(text_config()), backend="gpu")


def test_untested_transformers_version(monkeypatch):
    model = transformers.Inkling2TextModel(text_config())
    monkeypatch.setattr(inkling2.transformers, "__version__", "5.99.0")  # the module object it checks
    with pytest.raises(hf.UnsupportedTransformersError, match="tested with transformers 5.23.0, found 5.99.0"):
        hf.apply_attnres_kernels(model)
    assert not any(type(m).__name__.startswith("AttnResKernels") for m in model.modules())
    hf.apply_attnres_kernels(model, check_version=False)  # same Inkling2 source: allowed on request


def test_changed_inkling2_code(monkeypatch):
    """A transformers whose Inkling2 read (or layer) differs from the recorded source is refused, even
    with check_version=False, and nothing is patched; the error says whether the read patch alone
    (fuse_norms=False) still applies, and when it does, fuse_norms=False patches the reads."""
    model = transformers.Inkling2TextModel(text_config())

    def other_forward(self, block_states, partial_block_states):
        return (partial_block_states,)

    monkeypatch.setattr(hf_inkling2.Inkling2BlockAttentionResidual, "forward", other_forward)
    for fuse_norms in (True, False):
        with pytest.raises(hf.UnsupportedTransformersError) as error:
            hf.apply_attnres_kernels(model, check_version=False, fuse_norms=fuse_norms)
        assert "Inkling2BlockAttentionResidual changed" in str(error.value)
        assert "the read patch does not apply either" in str(error.value)
    monkeypatch.undo()
    monkeypatch.setitem(inkling2.FINGERPRINTS, "Inkling2FullDecoderLayer", "0" * 64)
    with pytest.raises(hf.UnsupportedTransformersError) as error:
        hf.apply_attnres_kernels(model)
    assert "Inkling2FullDecoderLayer changed" in str(error.value)
    assert "the read patch alone still applies: apply_attnres_kernels(model, fuse_norms=False)" in str(error.value)
    assert not any(type(m).__name__.startswith("AttnResKernels") for m in model.modules())
    hf.apply_attnres_kernels(model, fuse_norms=False)  # the layers are not patched: their source does not matter
    reads = [m for m in model.modules() if isinstance(m, hf_inkling2.Inkling2BlockAttentionResidual)]
    assert reads and all(type(m) is inkling2.AttnResKernelsBlockAttentionResidual for m in reads)
    assert {type(layer) for layer in model.layers} == {
        hf_inkling2.Inkling2SlidingDecoderLayer,
        hf_inkling2.Inkling2FullDecoderLayer,
    }


@pytest.mark.parametrize("fuse_norms", [True, False])
def test_remove_restores_the_unpatched_model(checkpoint, fuse_norms):
    """Patch, then remove: every module is again of its transformers class with no attribute of the
    patch left, the state dict is untouched, and logits and loss equal the unpatched model's bitwise
    (the same eager code runs). Removing twice is harmless and the model can be patched again."""
    eager, model = load(checkpoint, False), load(checkpoint, True, fuse_norms=fuse_norms)
    ids = batch()
    with torch.no_grad():
        want = eager(ids, labels=ids)
        assert (model(ids).logits - want.logits).abs().max() > 0  # patched: other rounding
    assert hf.remove_attnres_kernels(model) is model
    assert [(name, type(m)) for name, m in model.named_modules()] == [
        (name, type(m)) for name, m in eager.named_modules()
    ]
    assert not any("attnres_backend" in vars(m) for m in model.modules())
    sd_e, sd_m = eager.state_dict(), model.state_dict()
    assert list(sd_e) == list(sd_m) and all(torch.equal(sd_e[k], sd_m[k]) for k in sd_e)
    assert ops_run(lambda: model(ids)) == []
    with torch.no_grad():
        got = model(ids, labels=ids)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    hf.remove_attnres_kernels(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in eager.modules()]
    hf.apply_attnres_kernels(model)
    assert ops_run(lambda: model(ids)).count(FWD_OP) == N_READS


def test_remove_needs_an_inkling2_model():
    with pytest.raises(ValueError, match="no Inkling2BlockAttentionResidual"):
        hf.remove_attnres_kernels(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        hf.remove_attnres_kernels(None)


def test_unknown_subclass_is_refused():
    class Custom(hf_inkling2.Inkling2BlockAttentionResidual):
        def forward(self, block_states, partial_block_states):
            return super().forward(block_states, partial_block_states)

    model = torch.nn.ModuleDict({"read": Custom(text_config())})
    with pytest.raises(TypeError, match="subclass of Inkling2BlockAttentionResidual"):
        hf.apply_attnres_kernels(model)


def test_importable_without_transformers():
    """attnres_kernels.hf imports without transformers; using it says what to install."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import attnres_kernels, attnres_kernels.hf as hf\n"
        "try:\n    hf.apply_attnres_kernels(None)\n"
        "except ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "ERR" in out and "pip install 'attnres-kernels[hf]'" in out
    assert ak.hf is hf  # loaded as attnres_kernels.hf
