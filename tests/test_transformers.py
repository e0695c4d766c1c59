"""attn_implementation="dmattn" in transformers models matches their eager attention.

Each model runs three times with the same weights: eager in float64 (the reference), eager in
float32 (the baseline) and dmattn in float32 (the candidate), on a tiny random-init config, on
the CPU (kernels under Triton's interpreter) or, with ``--device cuda``, on the GPU.
Logits at non-padded positions and every parameter's gradient of a loss over those positions
go through kernels.tolerance's rule, measured in units of the reference's largest magnitude
(parameters' gradients span several orders of magnitude; the rule's floor is absolute). A
parameter is measured with the module that holds it: Doge's A sits in the attention module
itself, and its gradient, a sum over every key, cancels to about 1e-3 of its terms, so in its
own units the fp32 rounding of a correct bias gradient exceeds the floor.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers",
                                   reason="needs the hf extra: pip install -e '.[hf]'")

from attn_helpers import AllocationWatch  # noqa: E402
from kernels import KeyIntervals  # noqa: E402
from kernels.integrations import masking  # noqa: E402
from kernels.integrations import transformers as dm_hf  # noqa: E402
from kernels.tolerance import check_tensor  # noqa: E402

VOCAB = 97
SEQLEN = 13
PADDED = 4  # padded positions at the end of the second sequence
HIDDEN = 3  # a masked position inside the first
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
SLIDING_WINDOW = 5
DOGE_KEEP_WINDOWS = (8, 32)  # below and above SEQLEN


@pytest.fixture(scope="module", autouse=True)
def _registered():
    dm_hf.register()


def _models(config, device):
    """(eager float64, eager float32, dmattn float32), all with the eager model's weights."""
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation="eager")
    _randomize_doge_decay(eager)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                         attn_implementation="dmattn")
    ours.load_state_dict(eager.state_dict())
    eager, ours = eager.to(device), ours.to(device)
    return copy.deepcopy(eager).double(), eager, ours


def _dmattn_model(config, device):
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="dmattn").to(device)


def _randomize_doge_decay(model):
    # Doge initializes A to zero, which makes every key's bias 1: the top-W choice would be
    # among ties, which eager and the kernel may break differently.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A", None), torch.nn.Parameter):
                module.A.normal_()


def _batch(padded: bool, device=torch.device("cpu")):
    """Token ids and the 2-D attention mask. Padded: the second sequence is right-padded, and
    the first hides key HIDDEN, since under causality right padding is seen only by padded
    rows, whose outputs no check reads. Nothing is left-padded: a left-padded row sees no key,
    and transformers' float64 eager Doge turns such rows into NaN, which then reaches every
    position through the values. No token twice in a row: Doge's first layer computes its
    bias from the token alone, and equal biases would make the top-W choice a tie (see
    doge_biases)."""
    ids = torch.stack([torch.randperm(VOCAB)[:SEQLEN] for _ in range(2)])
    keep = torch.ones(2, SEQLEN, dtype=torch.long)
    if padded:
        keep[1, SEQLEN - PADDED:] = 0
        keep[0, HIDDEN] = 0
    return ids.to(device), keep.to(device)


def _run(model, ids, keep, weights, pass_mask, **inputs):
    """Logits at kept positions, and each parameter's gradient of a fixed weighted sum."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=keep if pass_mask else None, **inputs)
    logits = out.logits[keep.bool()]
    (logits * weights.to(logits.dtype)).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return logits.detach(), grads


def _check(name, actual, reference, baseline, dtype, scale=None):
    scale = scale or float(reference.abs().max()) or 1.0
    return check_tensor(name, actual / scale, reference / scale, baseline / scale, dtype)


def _module_scale(name, grads) -> float:
    """The largest reference gradient among the parameters of the module holding ``name``."""
    owner = name.rsplit(".", 1)[0] + "."
    return max(float(g.abs().max()) for n, g in grads.items() if n.startswith(owner))


def _assert_matches_eager(config, device, padded=True, pass_mask=True, autocast=None,
                          **inputs):
    """``autocast``: a dtype that the baseline and candidate run under autocast in."""
    reference, baseline, ours = _models(config, device)
    ids, keep = _batch(padded, device)
    weights = torch.randn(int(keep.sum()), VOCAB).to(device)
    runs = []
    for model in (reference, baseline, ours):
        context = torch.autocast(device.type, dtype=autocast,
                                 enabled=autocast is not None and model is not reference)
        with context:
            runs.append(_run(model, ids, keep, weights, pass_mask, **inputs))
    (ref_logits, ref_grads), (base_logits, base_grads), (our_logits, our_grads) = runs
    dtype = autocast or torch.float32
    checks = [_check("logits", our_logits, ref_logits, base_logits, dtype)]
    for name, ref_grad in ref_grads.items():
        assert our_grads[name] is not None, f"{name}: no gradient through dmattn"
        checks.append(_check(name, our_grads[name], ref_grad, base_grads[name], dtype,
                             _module_scale(name, ref_grads)))
    failed = [c.describe() for c in checks if not c.passed]
    assert not failed, "\n".join(failed)


def test_llama_right_padded_matches_eager(device):
    _assert_matches_eager(transformers.LlamaConfig(**TINY), device)


def test_llama_under_autocast_matches_eager(device):
    """fp32 weights under bf16 autocast, as mixed-precision training runs. Without a cache
    the value arrives in bf16 and query and key (rotated with fp32 cos and sin) in fp32: the
    kernel gets all three in autocast's dtype."""
    _assert_matches_eager(transformers.LlamaConfig(**TINY), device, autocast=torch.bfloat16,
                          use_cache=False)


def test_qwen2_right_padded_matches_eager(device):
    _assert_matches_eager(transformers.Qwen2Config(**TINY), device)


def test_llama_packed_sequences_match_eager(device):
    # Position ids that restart mark packed documents: key intervals per document here,
    # transformers' 4-D packed mask in eager.
    _assert_matches_eager(transformers.LlamaConfig(**TINY), device, padded=False,
                          pass_mask=False, position_ids=_packed_positions(device),
                          use_cache=False)


def test_mistral_packed_sequences_under_a_sliding_window_match_eager(device):
    config = transformers.MistralConfig(**TINY, sliding_window=SLIDING_WINDOW)
    _assert_matches_eager(config, device, padded=False, pass_mask=False,
                          position_ids=_packed_positions(device), use_cache=False)


def _packed_positions(device):
    """Position ids that restart at 6: two packed documents per row. transformers reads them
    as documents only without a cache (pass ``use_cache=False``)."""
    return torch.cat([torch.arange(6), torch.arange(SEQLEN - 6)])[None].expand(2, -1).to(device)


def test_mistral_sliding_window_matches_eager(device):
    _assert_matches_eager(transformers.MistralConfig(**TINY, sliding_window=SLIDING_WINDOW),
                          device)


def test_mistral_sliding_window_changes_the_result(device):
    """The window check above would be void if the window hid nothing at this length."""
    torch.manual_seed(1)
    windowed = transformers.MistralConfig(**TINY, sliding_window=SLIDING_WINDOW)
    model = _dmattn_model(windowed, device)
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.config.sliding_window = None
    ids, keep = _batch(padded=False, device=device)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, full(input_ids=ids).logits)


@pytest.fixture()
def doge_biases(monkeypatch):
    """Every per-key bias Doge's dmattn forward computes; the equivalence tests check that no
    row ties: on equal biases eager's torch.topk and the kernel may keep different keys (see
    test_doge_ties_rank_the_smaller_key_first), so a tie would fail them by chance."""
    biases = []
    real = dm_hf.doge_key_bias

    def spy(*args, **kwargs):
        biases.append(real(*args, **kwargs))
        return biases[-1]

    monkeypatch.setattr(dm_hf, "doge_key_bias", spy)
    yield biases
    assert biases, "Doge's dmattn forward never ran"
    for bias in biases:
        values = bias.detach().flatten(0, 2)
        assert all(len(set(row.tolist())) == row.numel() for row in values), "tied biases"


@pytest.mark.parametrize("keep_window", DOGE_KEEP_WINDOWS)
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_doge_matches_eager(doge_biases, device, keep_window, padded):
    _assert_matches_eager(transformers.DogeConfig(**TINY, keep_window_size=keep_window), device,
                          padded=padded)


def test_doge_sliding_window_matches_eager(doge_biases, device):
    config = transformers.DogeConfig(**TINY, keep_window_size=4, sliding_window=SLIDING_WINDOW)
    _assert_matches_eager(config, device)


def test_doge_packed_sequences_match_eager(doge_biases, device):
    # Each row keeps the top-W of its own document's keys: topk_intervals of the documents
    # as packed sequences here, transformers' 4-D packed mask in eager.
    config = transformers.DogeConfig(**TINY, keep_window_size=4)
    _assert_matches_eager(config, device, padded=False, pass_mask=False,
                          position_ids=_packed_positions(device), use_cache=False)


def test_doge_ties_rank_the_smaller_key_first():
    """Doge starts A at zero, so every key's bias is 1: eager keeps whichever keys torch.topk
    returns among the ties (on the CPU, not the smallest indices), the kernel path the smallest
    indices, on the interval path and the bool one alike."""
    bias = torch.ones(1, 1, 1, 6)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    intervals = masking.doge_masking(None, bias, seqlen_q=6, is_causal=True,
                                     sliding_window=None, keep_window=2)
    assert torch.equal(intervals.attn_mask.to_dense(6)[0, 0], expected)
    dense = masking.doge_masking(torch.ones(1, 1, 6, 6, dtype=torch.bool).tril(), bias,
                                 seqlen_q=6, is_causal=True, sliding_window=None, keep_window=2)
    assert torch.equal(dense.attn_mask[0, 0], expected)


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


def test_llama_padding_reaches_the_kernel_as_key_intervals(kernel_calls, device):
    ids, keep = _batch(padded=True, device=device)
    with torch.no_grad():
        _dmattn_model(transformers.LlamaConfig(**TINY), device)(input_ids=ids,
                                                                attention_mask=keep)
    assert len(kernel_calls) == TINY["num_hidden_layers"]
    for call in kernel_calls:
        assert call["is_causal"] is True
        intervals = call["attn_mask"]
        assert isinstance(intervals, KeyIntervals) and intervals.shape == (2, 1, SEQLEN)
        assert torch.equal(intervals.start, torch.zeros_like(intervals.start))
        assert torch.equal(intervals.end[:, 0], keep * SEQLEN)


def test_llama_packed_documents_reach_the_kernel_as_key_intervals(kernel_calls, device):
    """Position ids that restart at 6 (``_packed_positions``): each key is seen by its own
    document's rows, [0, 6) or [6, SEQLEN), with causality from the flag."""
    ids, _ = _batch(padded=False, device=device)
    with torch.no_grad():
        _dmattn_model(transformers.LlamaConfig(**TINY), device)(
            input_ids=ids, position_ids=_packed_positions(device), use_cache=False)
    start = torch.tensor([0] * 6 + [6] * (SEQLEN - 6), dtype=torch.int32, device=device)
    end = torch.tensor([6] * 6 + [SEQLEN] * (SEQLEN - 6), dtype=torch.int32, device=device)
    assert len(kernel_calls) == TINY["num_hidden_layers"]
    for call in kernel_calls:
        assert call["is_causal"] is True
        intervals = call["attn_mask"]
        assert isinstance(intervals, KeyIntervals) and intervals.shape == (2, 1, SEQLEN)
        assert torch.equal(intervals.start[:, 0], start.expand(2, -1))
        assert torch.equal(intervals.end[:, 0], end.expand(2, -1))


def test_doge_packed_documents_reach_the_kernel_as_key_intervals(kernel_calls, device):
    config = transformers.DogeConfig(**TINY, keep_window_size=4)
    ids, _ = _batch(padded=False, device=device)
    with torch.no_grad():
        _dmattn_model(config, device)(input_ids=ids, position_ids=_packed_positions(device),
                                      use_cache=False)
    assert len(kernel_calls) == TINY["num_hidden_layers"]
    for call in kernel_calls:
        intervals = call["attn_mask"]
        assert call["is_causal"] is True and tuple(call["attn_bias"].shape)[-2:] == (1, SEQLEN)
        assert isinstance(intervals, KeyIntervals)
        assert intervals.shape == (2, TINY["num_key_value_heads"], SEQLEN)
        causal = torch.ones(SEQLEN, SEQLEN, dtype=torch.bool, device=device).tril()
        kept = intervals.to_dense(SEQLEN) & causal
        assert int(kept.sum(-1).max()) == 4  # a row keeps at most the window
        assert not kept[..., 6:, :6].any()  # the second document's rows never see the first


@pytest.mark.parametrize("seed", range(4))
def test_doge_document_top_window_is_the_bool_choice(seed):
    """Over random documents (lengths 1 and up, B = 2) and biases with ties, each row keeps
    the same keys as the bool top-W over its document's visible keys."""
    generator = torch.Generator().manual_seed(seed)
    seqlen = 40
    restarts = torch.rand(2, seqlen, generator=generator) < 0.2
    restarts[:, 0] = True
    documents = restarts.long().cumsum(-1)
    intervals = masking.document_intervals(documents)
    bias = torch.randint(0, 5, (2, 3, 1, seqlen), generator=generator).float()
    for is_causal in (True, False):
        chosen = masking.document_top_window(intervals, bias, 3, is_causal)
        want = masking._bool_top_window(masking.Masking(intervals, None, is_causal), bias,
                                        seqlen, 3)
        dense = chosen.to_dense(seqlen)
        if is_causal:
            dense &= torch.ones(seqlen, seqlen).tril().bool()
        assert torch.equal(dense, want)


def test_document_intervals_follow_the_runs():
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5]])
    intervals = masking.document_intervals(documents)
    assert intervals.shape == (3, 1, 6) and intervals.start.dtype == torch.int32
    dense = intervals.to_dense(6)[:, 0]  # (B, rows, keys)
    assert torch.equal(dense, documents[:, :, None] == documents[:, None, :])


def test_llama_without_padding_passes_no_mask(kernel_calls, device):
    ids, keep = _batch(padded=False, device=device)
    with torch.no_grad():
        _dmattn_model(transformers.LlamaConfig(**TINY), device)(input_ids=ids,
                                                                attention_mask=keep)
    assert [c["attn_mask"] for c in kernel_calls] == [None] * TINY["num_hidden_layers"]


@pytest.mark.parametrize("keep_window", DOGE_KEEP_WINDOWS)
def test_doge_bias_and_top_window_reach_the_kernel_per_key(kernel_calls, device, keep_window):
    config = transformers.DogeConfig(**TINY, keep_window_size=keep_window)
    ids, keep = _batch(padded=True, device=device)
    _dmattn_model(config, device)(input_ids=ids, attention_mask=keep)
    heads_kv = TINY["num_key_value_heads"]
    assert len(kernel_calls) == TINY["num_hidden_layers"]
    for call in kernel_calls:
        assert tuple(call["attn_bias"].shape) == (2, heads_kv, 1, SEQLEN)
        # Unit key stride: kernels.warmup's "kv_row" bias's compile form.
        assert call["attn_bias"].stride(-1) == 1
        assert call["attn_bias"].requires_grad
        intervals = call["attn_mask"]
        assert isinstance(intervals, KeyIntervals)
        # Per KV head only where the top-W choice hides keys; padded keys are seen by no row.
        heads = heads_kv if SEQLEN > keep_window else 1
        assert intervals.shape == (2, heads, SEQLEN)
        assert not ((intervals.start < intervals.end) & ~keep.bool()[:, None, :]).any()


def _score_shaped(watch: AllocationWatch, seqlen: int) -> list[str]:
    return [f"{op} {shape}" for op, shape, _ in watch.fresh if shape.count(seqlen) >= 2]


@pytest.mark.parametrize("family", ["llama", "doge", "llama-packed", "doge-packed"])
def test_padded_batch_never_allocates_a_query_by_key_tensor(device, family):
    """Forward and backward of a padded batch, or of packed documents (position ids that
    restart, no attention mask), make no tensor with two sequence-length axes (an (L, L)
    mask, score or bias). The same watch catches eager attention's."""
    seqlen, keep_window = 37, 8  # 37: no other size of the model; the top-W hides keys
    config = (transformers.DogeConfig(**TINY, keep_window_size=keep_window)
              if family.startswith("doge") else transformers.LlamaConfig(**TINY))
    ids = torch.randint(0, VOCAB, (2, seqlen), device=device)
    keep = torch.ones(2, seqlen, dtype=torch.long, device=device)
    keep[1, seqlen - PADDED:] = 0
    keep[0, HIDDEN] = 0
    inputs = {"attention_mask": keep}
    if family.endswith("packed"):
        positions = torch.cat([torch.arange(20), torch.arange(seqlen - 20)])
        inputs = {"position_ids": positions[None].expand(2, -1).to(device), "use_cache": False}
    found = {}
    for implementation in ("dmattn", "eager"):
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=implementation).to(device)
        with AllocationWatch() as watch:
            model(input_ids=ids, **inputs).logits.sum().backward()
        found[implementation] = _score_shaped(watch, seqlen)
    assert found["eager"], "the watch saw none of eager attention's (L, L) tensors"
    assert not found["dmattn"], found["dmattn"]


# -- masks and arguments ----------------------------------------------------------------------

def test_doge_top_window_keeps_the_largest_visible_keys():
    bias = torch.tensor([[[[0.5, 3.0, 1.0, 2.0, 4.0]]]])
    result = masking.doge_masking(None, bias, seqlen_q=5, is_causal=True, sliding_window=None,
                                  keep_window=2)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 1, 1, 0, 0],
                             [0, 1, 0, 1, 0],
                             [0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(result.attn_mask.to_dense(5)[0, 0], expected)
    assert result.attn_bias is bias and result.is_causal is True


def test_doge_top_window_ranks_padded_keys_last():
    """A padded key of large bias neither is kept nor pushes a real key out."""
    bias = torch.tensor([[[[0.5, 9.0, 1.0, 2.0, 4.0]]]])
    padding = torch.tensor([[1, 0, 1, 1, 1]])
    result = masking.doge_masking(padding, bias, seqlen_q=5, is_causal=True,
                                  sliding_window=None, keep_window=2)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 0, 0, 0, 0],
                             [1, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(result.attn_mask.to_dense(5)[0, 0], expected)


@pytest.mark.parametrize("rows_per_step", [1024, 2])
def test_doge_bool_top_window_under_a_sliding_window(monkeypatch, rows_per_step):
    """Window 3 over a keep window of 2: key 1 is kept at row 1, pushed out at row 2 by key 2
    and back at row 3, when key 0 has left the window. Not one run of rows: a bool mask, made
    in steps of rows."""
    monkeypatch.setattr(masking, "ROWS_PER_TOPK_STEP", rows_per_step)
    bias = torch.tensor([[[[5.0, 1.0, 4.0, 0.1, 0.2]]]])
    result = masking.doge_masking(None, bias, seqlen_q=5, is_causal=True, sliding_window=3,
                                  keep_window=2)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 0, 1, 0, 0],
                             [0, 1, 1, 0, 0],
                             [0, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(result.attn_mask[0, 0], expected)
    assert result.attn_bias is bias and result.is_causal is False


def test_doge_sliding_window_within_the_keep_window_is_the_window():
    """A window of 2 under a keep window of 3 keeps every visible key: the window's intervals."""
    bias = torch.tensor([[[[5.0, 1.0, 4.0, 0.1, 0.2]]]])
    result = masking.doge_masking(None, bias, seqlen_q=5, is_causal=True, sliding_window=2,
                                  keep_window=3)
    window = masking.causal_family_masking(None, 5, 5, True, 2, bias.dtype, bias.device)
    assert isinstance(result.attn_mask, KeyIntervals) and result.is_causal is True
    assert torch.equal(result.attn_mask.to_dense(5), window.attn_mask.to_dense(5))
    assert result.attn_bias is bias


def test_float_mask_becomes_keep_mask_and_bias():
    low = torch.finfo(torch.float32).min
    mask = torch.tensor([[[[0.0, low, 0.25], [float("-inf"), 0.0, -1.0]]]])
    result = masking.causal_family_masking(mask, 2, 3, True, None, torch.float32, mask.device)
    keep = torch.tensor([[[[True, False, True], [False, True, True]]]])
    assert torch.equal(result.attn_mask, keep)
    assert torch.equal(result.attn_bias, torch.tensor([[[[0.0, 0.0, 0.25], [0.0, 0.0, -1.0]]]]))
    assert result.is_causal is False


def test_sliding_window_is_bottom_right_aligned():
    result = masking.causal_family_masking(None, 2, 5, True, 2, torch.float32,
                                           torch.device("cpu"))
    expected = torch.tensor([[False, False, True, True, True],
                             [False, False, False, True, True]])
    assert isinstance(result.attn_mask, KeyIntervals) and result.attn_mask.shape == (1, 1, 5)
    assert torch.equal(result.attn_mask.to_dense(2)[0, 0], expected)
    assert result.is_causal is True


def test_sliding_window_and_padding_intersect():
    padding = torch.tensor([[1, 1, 1, 0, 1]])
    result = masking.causal_family_masking(padding, 2, 5, True, 2, torch.float32,
                                           torch.device("cpu"))
    expected = torch.tensor([[False, False, True, False, True],
                             [False, False, False, False, True]])
    assert torch.equal(result.attn_mask.to_dense(2)[0, 0], expected)


def test_sliding_window_intervals_are_made_on_the_query_device():
    meta = torch.device("meta")
    result = masking.causal_family_masking(None, 2, 5, True, 2, torch.float32, meta)
    assert result.attn_mask.start.is_meta and result.attn_mask.end.is_meta


def test_bad_masks_and_dropout_are_rejected():
    with pytest.raises(ValueError, match="attention_mask"):
        masking.causal_family_masking(torch.ones(2, 1, 5, dtype=torch.bool), 5, 5, True, None,
                                      torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_mask"):
        masking.causal_family_masking(torch.ones(2, 4, dtype=torch.bool), 5, 5, True, None,
                                      torch.float32, torch.device("cpu"))
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="dropout"):
        dm_hf.dmattn_attention_forward(torch.nn.Module(), q, q, q, None, dropout=0.1)


@pytest.mark.parametrize("keep_window", DOGE_KEEP_WINDOWS)
def test_doge_compiles_whole(device, keep_window):
    """A Doge model on dmattn captures as one graph (fullgraph), with the top-W selection
    (keep window below the length) and without it, and matches its eager run."""
    config = transformers.DogeConfig(**TINY, keep_window_size=keep_window)
    model = _dmattn_model(config, device)
    _randomize_doge_decay(model)
    ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        got = compiled(input_ids=ids).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, model(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "doge"])
def test_packed_documents_compile_whole(device, family):
    """Packed documents (position ids that restart, no cache) capture as one graph too: the
    documents' intervals and, for Doge, the top-W of each document, matching the eager run."""
    config = (transformers.DogeConfig(**TINY, keep_window_size=4) if family == "doge"
              else transformers.LlamaConfig(**TINY))
    model = _dmattn_model(config, device)
    _randomize_doge_decay(model)
    ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids.to(device), position_ids=_packed_positions(device),
                  use_cache=False)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        got = compiled(**inputs).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, model(**inputs).logits, rtol=0, atol=0)


def test_doge_decode_steps_read_only_the_kept_keys(device, monkeypatch):
    """A cache of 64 keys and keep_window 4: each decode step (one new token, no gradient)
    takes the gather route, whose lists hold the step's top-4 keys, and gives the logits the
    tile walk gives over the same cache. (Against eager the biases of this cache tie, and
    ties may keep other keys: ``doge_biases``.)"""
    from kernels.planning import forward_schedule
    from kernels.planning.gather_decode import GatherDecodePlan

    gathered = []
    real_run = GatherDecodePlan.run
    monkeypatch.setattr(GatherDecodePlan, "run",
                        lambda self, *a, **k: gathered.append(1) or real_run(self, *a, **k))
    config = transformers.DogeConfig(**TINY, keep_window_size=4)
    ours = _dmattn_model(config, device)
    _randomize_doge_decay(ours)
    prompt = torch.randint(0, VOCAB, (2, 64), device=device)
    step = torch.randint(0, VOCAB, (2, 1), device=device)

    def decode_step():
        with torch.no_grad():
            cache = ours(input_ids=prompt, use_cache=True).past_key_values
            return ours(input_ids=step, past_key_values=cache, use_cache=True).logits

    got = decode_step()
    assert len(gathered) == TINY["num_hidden_layers"]
    monkeypatch.setattr(forward_schedule, "gather_tile", lambda problem, forced=False: None)
    from kernels import call_plan

    call_plan._interval_plans.clear()  # plans are kept by call form: make them again
    walked = decode_step()
    assert len(gathered) == TINY["num_hidden_layers"]
    # The two routes sum the kept keys in other orders: fp32 rounding apart.
    check = check_tensor("logits", got, walked, walked, torch.float32)
    assert check.passed, check.describe()
