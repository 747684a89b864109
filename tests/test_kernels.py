"""Triton kernels (``kernels/``) against the PyTorch references.

* The numerical cases (fp32, fp16, small sizes) run in Triton's interpreter on the CPU, in a child
  process started here with ``TRITON_INTERPRET=1`` (interpreter mode is fixed, process-wide, when triton
  is imported, so it must not leak into this process): ``tests/_kernel_cases.py``.
* Argument checking and the block-index transpose run here, with the kernel modules in their normal mode.
* bf16 and large sizes need a CUDA device (``gpu`` marker).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._kernel_utils import all_blocks, check_block_sparse, check_dense, random_blocks

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def interpreter_run(tmp_path_factory):
    """The interpreter cases, started in a child process on first use (other tests run meanwhile)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "tests/_kernel_cases.py", "-q", "-p", "no:cacheprovider", "--durations=5"]
    log_path = tmp_path_factory.mktemp("kernel_cases") / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        yield proc, log_path, cmd
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _signature(kernel, dtype: str, consts: dict) -> dict[str, str]:
    """Argument types of a kernel, from the argument names used in ``kernels/``."""
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("LSE", "DELTA", "SINK"):
            sig[name] = "*fp32"
        elif name == "KPM":
            sig[name] = "*u8"
        elif name in ("IDX", "TIDX"):
            sig[name] = "*i32"
        elif name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV_"):
            sig[name] = f"*{dtype}"
        elif name in ("qk_scale", "sm_scale", "cap_in", "cap_out"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def test_kernels_compile_for_a_gpu_target(interpreter_run):
    """Compile every kernel for sm_90 without a GPU: catches code the interpreter accepts but the compiler
    rejects (types changing across branches, dot shapes, layouts). Runs while the interpreter cases run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    fa, bs = _fa(), _bs()
    dense = dict(D=32, DV=32, BLOCK_D=32, BLOCK_DV=32, BLOCK_M=32, BLOCK_N=16, CAUSAL=True, HAS_PAD=True,
                 EVEN_M=False, EVEN_N=False, PRECISION="tf32")  # fmt: skip
    sparse = {**{k: v for k, v in dense.items() if not k.startswith("BLOCK_") or k in ("BLOCK_D", "BLOCK_DV")}, "BLOCK": 32}
    extras = [dict(HAS_WINDOW=w, HAS_SOFTCAP=c) for w, c in ((False, False), (True, True))]
    bidir = {**dense, "CAUSAL": False, "HAS_WINDOW": True, "HAS_SOFTCAP": False}  # the symmetric window's bounds
    jobs = [(fa._attn_fwd, {**dense, **e, "HAS_SINK": e["HAS_WINDOW"]}) for e in extras]
    jobs += [(kern, {**dense, **e}) for kern in (fa._attn_bwd_dkdv, fa._attn_bwd_dq) for e in extras]
    jobs += [(fa._attn_fwd, {**bidir, "HAS_SINK": False}), (fa._attn_bwd_dkdv, bidir), (fa._attn_bwd_dq, bidir)]
    jobs += [(fa._attn_bwd_preprocess, dict(DV=32, BLOCK_DV=32, BLOCK_M=32, EVEN_M=False)),
             (bs._bs_fwd, sparse), (bs._bs_bwd_dq, sparse), (bs._bs_bwd_dkdv, sparse)]  # fmt: skip
    for kernel, consts in jobs:
        src = ASTSource(fn=kernel, signature=_signature(kernel, "fp16", consts), constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
        assert compiled.asm.get("cubin"), f"{kernel.fn.__name__}: no cubin"


def test_kernels_match_references_under_triton_interpreter(interpreter_run):
    proc, log_path, cmd = interpreter_run
    try:
        rc = proc.wait(timeout=850)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    out = log_path.read_text()
    tail = out[-6000:]
    assert rc == 0, f"interpreter cases failed ({' '.join(cmd)}):\n{tail}"
    last = out.strip().splitlines()[-1]
    assert " passed" in last, tail
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert all("address space" in line for line in skips), tail  # only the far-offset cases may skip, for want of it


def _fa():
    import kernels.flash_attention as fa

    return fa


def _bs():
    import kernels.block_sparse as bs

    return bs


def test_flash_attention_rejects_what_it_does_not_support():
    fa = _fa()
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="attn_bias"):
        fa.flash_attention(q, q, q, attn_bias=torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match="head dim 8 "):
        fa.flash_attention(q[..., :8], q[..., :8], q[..., :8])
    big = torch.randn(1, 1, 4, 256)
    with pytest.raises(ValueError, match="head dim 256 "):
        fa.flash_attention(big, big, big)
    with pytest.raises(ValueError, match="float64"):
        fa.flash_attention(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match=r"key/value heads \(2\) must divide query heads \(3\)"):
        fa.flash_attention(torch.randn(1, 3, 8, 32), q, q)
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        fa.flash_attention(q, q, q, key_padding_mask=torch.zeros(1, 8))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 set for the whole run")
def test_kernels_refuse_cpu_tensors_outside_interpreter():
    """Compiled kernels need CUDA tensors and say so (core then falls back to another backend)."""
    fa, bs = _fa(), _bs()
    assert not fa.is_interpreted()
    q = torch.randn(1, 1, 32, 32)
    with pytest.raises(ValueError, match="CUDA tensors, got device cpu"):
        fa.flash_attention(q, q, q)
    with pytest.raises(ValueError, match="CUDA tensors, got device cpu"):
        bs.block_sparse_attention(q, q, q, all_blocks(1, 1, 2, 2), block_size=16)


def test_in_tile_offsets_stay_int32_by_copying_or_refusing():
    """Base offsets are int64 in the kernels; in-tile ones are int32, so a view whose rows are too far apart
    is copied to contiguous first, and a (batch, head) with S*D past 2**31 is refused (meta tensors: no memory)."""
    fa = _fa()
    fine = torch.empty(64, 32, 8192, 128, device="meta")  # 2**31 elements, but a (batch, head) spans S*D = 2**20
    assert fa.compact_rows(fine, "q") is fine
    bshd = torch.empty(1, 2**20, 32, 128, device="meta").transpose(1, 2)  # (B, H, S, D) view, row stride H*D
    assert fa.tile_span(bshd) > fa.INT32_MAX
    copied = fa.compact_rows(bshd, "q")
    assert copied.is_contiguous() and copied.shape == bshd.shape and fa.tile_span(copied) <= fa.INT32_MAX
    with pytest.raises(ValueError, match=r"q of shape \(1, 1, 16777216, 128\).*S\*D = 2147483648"):
        fa.compact_rows(torch.empty(1, 1, 2**24, 128, device="meta"), "q")


def test_block_sparse_rejects_bad_index_and_block_size():
    bs = _bs()
    q = torch.randn(1, 2, 40, 32)
    good = all_blocks(1, 2, 3, 3)
    with pytest.raises(ValueError, match="block_size must be an int in 1..128"):
        bs.block_sparse_attention(q, q, q, good, block_size=256)
    with pytest.raises(ValueError, match=r"shape \(B, H_q, NQ, K\) = \(1, 2, 3, K\)"):
        bs.block_sparse_attention(q, q, q, good[:, :, :2], block_size=16)
    with pytest.raises(ValueError, match=r"lie in \[-1, 2\]"):
        bs.block_sparse_attention(q, q, q, good + 1, block_size=16)
    dup = good.clone()
    dup[0, 0, 0, 1] = 0
    with pytest.raises(ValueError, match="duplicated"):
        bs.block_sparse_attention(q, q, q, dup, block_size=16)
    with pytest.raises(ValueError, match="integer"):
        bs.block_sparse_attention(q, q, q, good.float(), block_size=16)
    with pytest.raises(ValueError, match="head dim 8 "):
        bs.block_sparse_attention(q[..., :8], q[..., :8], q[..., :8], good, block_size=16)


def test_transpose_block_index_lists_every_selection():
    bs = _bs()
    B, Hq, groups, nq, nk = 2, 4, 2, 5, 7
    idx = random_blocks(B, Hq, nq, nk, 3)
    t = bs.transpose_block_index(idx, nk=nk, groups=groups)  # (B, Hkv, NK, Kt)
    assert t.shape[:3] == (B, Hq // groups, nk)
    expected = {
        (b, h // groups, int(idx[b, h, qb, s]), (h % groups) * nq + qb) for b, h, qb, s in (idx >= 0).nonzero().tolist()
    }
    got = {(b, hk, n, int(t[b, hk, n, s])) for b, hk, n, s in (t >= 0).nonzero().tolist()}
    assert got == expected
    assert t.shape[3] == max(sum(1 for e in expected if e[:3] == (b, hk, n)) for b, hk, n, _ in expected)
    valid = torch.where(t >= 0, t, torch.iinfo(torch.int32).max)
    assert (valid[..., 1:] >= valid[..., :-1]).all()  # ascending, -1 only at the end


# ------------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "B,Hq,Hkv,Sq,Sk,D,causal,pad",
    [
        (2, 8, 2, 1023, 1023, 128, True, True),
        (1, 4, 4, 513, 2048, 64, False, False),
        (2, 4, 1, 2048, 300, 96, True, False),
        (1, 2, 2, 4096, 4096, 128, True, False),
    ],
)
def test_flash_attention_gpu(B, Hq, Hkv, Sq, Sk, D, causal, pad, dtype):
    check_dense(_fa(), B, Hq, Hkv, Sq, Sk, D, causal, pad, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [64, 128])
def test_block_sparse_gpu(dtype, block):
    check_block_sparse(_bs(), 2, 8, 2, 1000, 1500, 64, block, True, True, dtype, 6, device="cuda")
