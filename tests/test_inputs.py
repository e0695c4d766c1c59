"""Bad input is refused with TypeError/ValueError naming the argument, and CPU
tensors without the interpreter get an error that says how to turn it on."""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from kernels import attention_reference, dmattn_func, triton_dmattn_func

ENTRY_POINTS = (
    pytest.param(dmattn_func, id="dmattn_func"),
    pytest.param(triton_dmattn_func, id="triton_dmattn_func"),
    pytest.param(attention_reference, id="reference"),
)

B, LQ, LK, HQ, HK, D = 2, 5, 7, 4, 2, 16


def _good(device, dtype=torch.float16):
    """Valid arguments of dmattn_func; each bad case below changes one of them."""
    return dict(
        query=torch.randn(B, LQ, HQ, D, device=device).to(dtype),
        key=torch.randn(B, LK, HK, D, device=device).to(dtype),
        value=torch.randn(B, LK, HK, D, device=device).to(dtype),
        attn_mask=torch.ones(B, HK, LQ, LK, dtype=torch.bool, device=device),
        attn_bias=torch.zeros(1, HQ, LQ, LK, device=device).to(dtype),
        softmax_scale=None,
    )


def _randn(*shape, dtype=torch.float16):
    return lambda device: torch.randn(*shape, device=device).to(dtype)


def _bools(*shape):
    return lambda device: torch.ones(*shape, dtype=torch.bool, device=device)


def _value(v):
    return lambda device: v


# (argument(s) replaced, bad value(s), expected exception, words the message must contain)
BAD_INPUTS = (
    pytest.param("query", _randn(B, LQ, HQ * D), ValueError, ["query", "4-D"], id="query_rank3"),
    pytest.param("key", _randn(1, B, LK, HK, D), ValueError, ["key", "4-D"], id="key_rank5"),
    pytest.param("value", _randn(B, LK, HK), ValueError, ["value", "4-D"], id="value_rank3"),
    pytest.param("attn_mask", _bools(LQ, LK), ValueError, ["attn_mask", "4-D"],
                 id="mask_rank2"),
    pytest.param("attn_bias", _randn(HQ, LQ, LK), ValueError, ["attn_bias", "4-D"],
                 id="bias_rank3"),
    pytest.param(("key", "value"), (_randn(B, LK, 3, D), _randn(B, LK, 3, D)), ValueError,
                 ["query", "key", "heads", "multiple"], id="heads_not_divisible"),
    pytest.param("key", _randn(B, LK, HK, D + 8), ValueError, ["key", "head_dim"],
                 id="key_head_dim"),
    pytest.param("value", _randn(B, LK, HK, D + 8), ValueError, ["value"],
                 id="value_head_dim"),
    pytest.param("key", _randn(B + 1, LK, HK, D), ValueError, ["key", "batch"],
                 id="key_batch"),
    pytest.param("value", _randn(B + 1, LK, HK, D), ValueError, ["value"], id="value_batch"),
    pytest.param("value", _randn(B, LK + 1, HK, D), ValueError, ["value"], id="value_seqlen"),
    pytest.param("key", lambda device: torch.randn(B, LK, HK, D, device="meta").half(),
                 ValueError, ["key", "device"], id="key_device"),
    pytest.param("value", lambda device: torch.randn(B, LK, HK, D, device="meta").half(),
                 ValueError, ["value", "device"], id="value_device"),
    pytest.param("attn_mask", lambda device: torch.ones(B, HK, LQ, LK, dtype=torch.bool,
                                                        device="meta"),
                 ValueError, ["attn_mask", "device"], id="mask_device"),
    pytest.param("attn_bias", lambda device: torch.zeros(B, HK, LQ, LK, device="meta").half(),
                 ValueError, ["attn_bias", "device"], id="bias_device"),
    pytest.param(("query", "key", "value"), (_randn(B, LQ, HQ, 257), _randn(B, LK, HK, 257),
                                             _randn(B, LK, HK, 257)),
                 ValueError, ["query", "256"], id="head_dim_over_256"),
    pytest.param("query", _randn(B, LQ, HQ, D, dtype=torch.float64), TypeError,
                 ["query", "dtype"], id="query_float64"),
    pytest.param("query", _randn(B, LQ, HQ, D, dtype=torch.int32), TypeError,
                 ["query", "dtype"], id="query_int"),
    pytest.param("key", _randn(B, LK, HK, D, dtype=torch.float32), TypeError, ["key", "dtype"],
                 id="key_dtype"),
    pytest.param("value", _randn(B, LK, HK, D, dtype=torch.bfloat16), TypeError,
                 ["value", "dtype"], id="value_dtype"),
    pytest.param("attn_mask", _randn(B, HK, LQ, LK), TypeError, ["attn_mask", "bool"],
                 id="mask_float"),
    pytest.param("attn_mask", lambda device: torch.ones(B, HK, LQ, LK, dtype=torch.uint8,
                                                        device=device),
                 TypeError, ["attn_mask", "bool"], id="mask_uint8"),
    pytest.param("attn_mask", _value([[True]]), TypeError, ["attn_mask"], id="mask_list"),
    pytest.param("attn_bias", _randn(B, HK, LQ, LK, dtype=torch.float32), TypeError,
                 ["attn_bias", "dtype"], id="bias_dtype"),
    pytest.param("attn_bias", _randn(B, HK, LQ, LK, dtype=torch.bfloat16), TypeError,
                 ["attn_bias", "dtype"], id="bias_bf16_for_fp16"),
    pytest.param("attn_mask", _bools(B + 1, HK, LQ, LK), ValueError, ["attn_mask", "batch"],
                 id="mask_batch"),
    pytest.param("attn_mask", _bools(B, 3, LQ, LK), ValueError, ["attn_mask", "heads"],
                 id="mask_heads"),
    pytest.param("attn_mask", _bools(B, HK, LQ + 1, LK), ValueError, ["attn_mask", "seqlen_q"],
                 id="mask_seqlen_q"),
    pytest.param("attn_mask", _bools(B, HK, LQ, 2), ValueError, ["attn_mask", "seqlen_k"],
                 id="mask_seqlen_k"),
    pytest.param("attn_bias", _randn(3, HQ, LQ, LK), ValueError, ["attn_bias", "batch"],
                 id="bias_batch"),
    pytest.param("attn_bias", _randn(1, 2 * HQ, LQ, LK), ValueError, ["attn_bias", "heads"],
                 id="bias_heads"),
    pytest.param("attn_bias", _randn(1, HQ, 2, LK), ValueError, ["attn_bias", "seqlen_q"],
                 id="bias_seqlen_q"),
    pytest.param("attn_bias", _randn(1, HQ, LQ, LK - 1), ValueError, ["attn_bias", "seqlen_k"],
                 id="bias_seqlen_k"),
    pytest.param("query", _randn(0, LQ, HQ, D), ValueError, ["query", "empty"],
                 id="query_empty_batch"),
    pytest.param("query", _randn(B, 0, HQ, D), ValueError, ["query", "empty"],
                 id="query_empty_seqlen"),
    pytest.param("key", _randn(B, 0, HK, D), ValueError, ["key", "empty"],
                 id="key_empty_seqlen"),
    pytest.param("value", _randn(B, 0, HK, D), ValueError, ["value"], id="value_empty"),
    pytest.param("query", _randn(B, LQ, HQ, 0), ValueError, ["query", "empty"],
                 id="query_empty_head_dim"),
    pytest.param("attn_mask", _bools(B, HK, LQ, 0), ValueError, ["attn_mask"],
                 id="mask_empty"),
    pytest.param("attn_bias", _randn(B, HK, 0, LK), ValueError, ["attn_bias"], id="bias_empty"),
    pytest.param("softmax_scale", _value(math.inf), ValueError, ["softmax_scale", "finite"],
                 id="scale_inf"),
    pytest.param("softmax_scale", _value(-math.inf), ValueError, ["softmax_scale", "finite"],
                 id="scale_neg_inf"),
    pytest.param("softmax_scale", _value(math.nan), ValueError, ["softmax_scale", "finite"],
                 id="scale_nan"),
    pytest.param("softmax_scale", _value("0.5"), TypeError, ["softmax_scale"], id="scale_str"),
)


@pytest.mark.parametrize("argument, bad, error, words", BAD_INPUTS)
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_bad_input_is_refused(argument, bad, error, words, entry_point, device):
    kwargs = _good(device)
    if isinstance(argument, tuple):
        kwargs.update({name: make(device) for name, make in zip(argument, bad)})
    else:
        kwargs[argument] = bad(device)
    with pytest.raises(error) as raised:
        entry_point(**kwargs)
    message = str(raised.value)
    missing = [w for w in words if w not in message]
    assert not missing, f"message {message!r} does not mention {missing}"


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_good_input_passes_the_checks(entry_point, device):
    """The baseline every bad case above departs from is itself accepted."""
    out = entry_point(**_good(device))
    assert out.shape == (B, LQ, HQ, D)


NON_TENSOR_ENTRY_POINTS = (
    pytest.param(dmattn_func, id="dmattn_func"),
    pytest.param(triton_dmattn_func, id="triton_dmattn_func"),
    pytest.param(attention_reference, id="reference"),
)
QKV_ARGUMENTS = ("query", "key", "value")


@pytest.mark.parametrize("argument", QKV_ARGUMENTS)
@pytest.mark.parametrize("entry_point", NON_TENSOR_ENTRY_POINTS)
def test_non_tensor_is_a_type_error(argument, entry_point, device):
    kwargs = _good(device)
    kwargs[argument] = kwargs[argument].tolist()
    with pytest.raises(TypeError, match=argument):
        entry_point(**kwargs)


@pytest.mark.parametrize("flag", ["is_causal", "return_lse", "deterministic"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_flag_that_is_not_a_bool_is_a_type_error(flag, value, device):
    kwargs = _good(device)
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        dmattn_func(**kwargs, **{flag: value})


def _run_python(code: str, *flags: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    root = str(Path(kernels.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_without_interpreter_says_how_to_enable_it():
    result = _run_python("""
        import torch
        from kernels import dmattn_func
        q = torch.randn(1, 4, 2, 16)
        try:
            dmattn_func(q, q, q)
        except RuntimeError as e:
            print("RuntimeError:", e)
        else:
            print("no error")
    """, interpret=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("RuntimeError:"), result.stdout + result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout


def test_checks_survive_python_O():
    """Input checks are real raises, not asserts that ``python -O`` strips."""
    result = _run_python("""
        import torch
        from kernels import dmattn_func
        q = torch.randn(1, 4, 3, 16)
        k = torch.randn(1, 4, 2, 16)
        try:
            dmattn_func(q, k, k)
        except ValueError as e:
            print("ValueError:", e)
    """, "-O", interpret=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ValueError:"), result.stdout + result.stderr


def _is_triton_jit(decorator: ast.expr) -> bool:
    return "jit" in ast.unparse(decorator)


def test_no_bare_asserts_in_host_code():
    """``assert`` in host code disappears under -O; device code (triton.jit) may use it."""
    offenders = []
    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        jitted = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(map(_is_triton_jit, node.decorator_list)):
                jitted.update(id(n) for n in ast.walk(node))
        offenders += [f"{path.name}:{n.lineno}" for n in ast.walk(tree)
                      if isinstance(n, ast.Assert) and id(n) not in jitted]
    assert not offenders, f"bare asserts in host code: {offenders}"
