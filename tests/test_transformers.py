"""attn_implementation="dmattn" in transformers models matches their eager attention.

Each model runs three times with the same weights: eager in float64 (the reference), eager in
float32 (the baseline) and dmattn in float32 (the candidate), on a tiny random-init config.
Logits at non-padded positions and every parameter's gradient of a loss over those positions
go through kernels.tolerance's rule, measured in units of the reference's largest magnitude
(parameters' gradients span several orders of magnitude; the rule's floor is absolute).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers",
                                   reason="needs the hf extra: pip install -e '.[hf]'")

from kernels.integrations import transformers as dm_hf  # noqa: E402
from kernels.tolerance import check_tensor  # noqa: E402

VOCAB = 97
SEQLEN = 13
PADDED = 4  # padded positions at the end of the second sequence
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
SLIDING_WINDOW = 5
DOGE_KEEP_WINDOWS = (8, 32)  # below and above SEQLEN


@pytest.fixture(scope="module", autouse=True)
def _registered():
    dm_hf.register()


def _models(config):
    """(eager float64, eager float32, dmattn float32), all with the eager model's weights."""
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation="eager")
    _randomize_doge_decay(eager)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                         attn_implementation="dmattn")
    ours.load_state_dict(eager.state_dict())
    return copy.deepcopy(eager).double(), eager, ours


def _randomize_doge_decay(model):
    # Doge initializes A to zero, which makes every key's bias 1: the top-W choice would be
    # among ties, which eager and the kernel may break differently.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A", None), torch.nn.Parameter):
                module.A.normal_()


def _batch(padded: bool):
    # Right padding only: a left-padded row sees no key, and transformers' float64 eager Doge
    # turns such rows into NaN, which then reaches every position through the values.
    ids = torch.randint(0, VOCAB, (2, SEQLEN))
    keep = torch.ones(2, SEQLEN, dtype=torch.long)
    if padded:
        keep[1, SEQLEN - PADDED:] = 0
    return ids, keep


def _run(model, ids, keep, weights, pass_mask, **inputs):
    """Logits at kept positions, and each parameter's gradient of a fixed weighted sum."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=keep if pass_mask else None, **inputs)
    logits = out.logits[keep.bool()]
    (logits * weights.to(logits.dtype)).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return logits.detach(), grads


def _check(name, actual, reference, baseline):
    scale = float(reference.abs().max()) or 1.0
    return check_tensor(name, actual / scale, reference / scale, baseline / scale, torch.float32)


def _assert_matches_eager(config, padded=True, pass_mask=True, **inputs):
    reference, baseline, ours = _models(config)
    ids, keep = _batch(padded)
    weights = torch.randn(int(keep.sum()), VOCAB)
    (ref_logits, ref_grads), (base_logits, base_grads), (our_logits, our_grads) = [
        _run(m, ids, keep, weights, pass_mask, **inputs) for m in (reference, baseline, ours)]
    checks = [_check("logits", our_logits, ref_logits, base_logits)]
    for name, ref_grad in ref_grads.items():
        assert our_grads[name] is not None, f"{name}: no gradient through dmattn"
        checks.append(_check(name, our_grads[name], ref_grad, base_grads[name]))
    failed = [c.describe() for c in checks if not c.passed]
    assert not failed, "\n".join(failed)


def test_llama_right_padded_matches_eager():
    _assert_matches_eager(transformers.LlamaConfig(**TINY))


def test_qwen2_right_padded_matches_eager():
    _assert_matches_eager(transformers.Qwen2Config(**TINY))


def test_llama_packed_sequences_match_eager():
    # Position ids that restart mark packed documents: transformers' 4-D mask path.
    positions = torch.cat([torch.arange(6), torch.arange(SEQLEN - 6)])[None].expand(2, -1)
    _assert_matches_eager(transformers.LlamaConfig(**TINY), padded=False, pass_mask=False,
                          position_ids=positions)


def test_mistral_sliding_window_matches_eager():
    _assert_matches_eager(transformers.MistralConfig(**TINY, sliding_window=SLIDING_WINDOW))


def test_mistral_sliding_window_changes_the_result():
    """The window check above would be void if the window hid nothing at this length."""
    torch.manual_seed(1)
    windowed = transformers.MistralConfig(**TINY, sliding_window=SLIDING_WINDOW)
    model = transformers.AutoModelForCausalLM.from_config(windowed, attn_implementation="dmattn")
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.config.sliding_window = None
    ids, keep = _batch(padded=False)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, full(input_ids=ids).logits)


@pytest.mark.parametrize("keep_window", DOGE_KEEP_WINDOWS)
def test_doge_matches_eager(keep_window):
    _assert_matches_eager(transformers.DogeConfig(**TINY, keep_window_size=keep_window))


def test_doge_sliding_window_matches_eager():
    config = transformers.DogeConfig(**TINY, keep_window_size=4, sliding_window=SLIDING_WINDOW)
    _assert_matches_eager(config)


# -- what reaches the kernel ------------------------------------------------------------------

@pytest.fixture()
def kernel_calls(monkeypatch):
    calls = []
    real = dm_hf.dmattn_func

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(dm_hf, "dmattn_func", spy)
    return calls


def test_llama_padding_reaches_the_kernel_as_a_key_mask(kernel_calls):
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY),
                                                          attn_implementation="dmattn")
    ids, keep = _batch(padded=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=keep)
    assert len(kernel_calls) == TINY["num_hidden_layers"]
    for call in kernel_calls:
        assert call["is_causal"] is True
        assert tuple(call["attn_mask"].shape) == (2, 1, 1, SEQLEN)
        assert torch.equal(call["attn_mask"][:, 0, 0], keep.bool())


def test_llama_without_padding_passes_no_mask(kernel_calls):
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY),
                                                          attn_implementation="dmattn")
    ids, keep = _batch(padded=False)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=keep)
    assert [c["attn_mask"] for c in kernel_calls] == [None] * TINY["num_hidden_layers"]


@pytest.mark.parametrize("keep_window", DOGE_KEEP_WINDOWS)
def test_doge_bias_reaches_the_kernel_per_key(kernel_calls, keep_window):
    config = transformers.DogeConfig(**TINY, keep_window_size=keep_window)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="dmattn")
    ids, keep = _batch(padded=True)
    model(input_ids=ids, attention_mask=keep)
    heads_kv = TINY["num_key_value_heads"]
    for call in kernel_calls:
        assert tuple(call["attn_bias"].shape) == (2, heads_kv, 1, SEQLEN)
        assert call["attn_bias"].requires_grad
        # A (B, Hk, Lq, Lk) top-W mask only with more keys than the keep window.
        expected = (2, heads_kv, SEQLEN, SEQLEN) if SEQLEN > keep_window else (2, 1, 1, SEQLEN)
        assert tuple(call["attn_mask"].shape) == expected


@pytest.mark.parametrize("rows_per_step", [1024, 2])
def test_doge_top_window_keeps_the_largest_visible_keys(monkeypatch, rows_per_step):
    monkeypatch.setattr(dm_hf, "ROWS_PER_TOPK_STEP", rows_per_step)
    bias = torch.tensor([[[[0.5, 3.0, 1.0, 2.0, 4.0]]]])
    masking = dm_hf.doge_masking(None, bias, seqlen_q=5, is_causal=True, sliding_window=None,
                                 keep_window=2)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 1, 1, 0, 0],
                             [0, 1, 0, 1, 0],
                             [0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(masking.attn_mask[0, 0], expected)
    assert masking.attn_bias is bias and masking.is_causal is False


# -- masks and arguments ----------------------------------------------------------------------

def test_float_mask_becomes_keep_mask_and_bias():
    low = torch.finfo(torch.float32).min
    mask = torch.tensor([[[[0.0, low, 0.25], [float("-inf"), 0.0, -1.0]]]])
    masking = dm_hf.causal_family_masking(mask, 2, 3, True, None, torch.float32, mask.device)
    keep = torch.tensor([[[[True, False, True], [False, True, True]]]])
    assert torch.equal(masking.attn_mask, keep)
    assert torch.equal(masking.attn_bias, torch.tensor([[[[0.0, 0.0, 0.25], [0.0, 0.0, -1.0]]]]))
    assert masking.is_causal is False


def test_sliding_window_band_is_bottom_right_aligned():
    masking = dm_hf.causal_family_masking(None, 2, 5, True, 2, torch.float32, torch.device("cpu"))
    expected = torch.tensor([[False, False, True, True, True],
                             [False, False, False, True, True]])
    assert torch.equal(masking.attn_mask[0, 0], expected)


def test_sliding_window_band_is_made_on_the_query_device():
    meta = torch.device("meta")
    assert dm_hf.causal_family_masking(None, 2, 5, True, 2, torch.float32, meta).attn_mask.is_meta


def test_bad_masks_and_dropout_are_rejected():
    with pytest.raises(ValueError, match="attention_mask"):
        dm_hf.causal_family_masking(torch.ones(2, 1, 5, dtype=torch.bool), 5, 5, True, None,
                                    torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_mask"):
        dm_hf.causal_family_masking(torch.ones(2, 4, dtype=torch.bool), 5, 5, True, None,
                                    torch.float32, torch.device("cpu"))
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="dropout"):
        dm_hf.dmattn_attention_forward(torch.nn.Module(), q, q, q, None, dropout=0.1)
