"""Python binding of libdejavu_kernels (plugins/, C ABI in plugins/common/dejavu_kernels.h).

ctypes over the C ABI. Every call enqueues on ``torch.cuda.current_stream()`` and never synchronises
with the host, so a sequence of calls can be captured in a CUDA graph. Workspaces are zero-filled
device buffers cached per (device, op) and reused (the kernels leave their counters at zero), grown
when a call needs more (the replaced buffer stays allocated: a CUDA graph captured with it still uses it);
pass ``workspace=`` (a uint8 CUDA tensor of at least ``*_workspace_size(...)`` bytes, zero-filled once)
to own it instead, e.g. one per concurrent stream. Two ops running concurrently on different streams
must not share a workspace.

Library lookup: ``$DEJAVU_KERNELS_LIB``, else ``plugins/build/libdejavu_kernels.so`` in the repository
(build it with ``python -m dejavu_trt.kernels.build``). ``available()`` says whether it loads.

Functions (fp16 or bf16 tensors, contiguous, on one CUDA device; index tensors int32, ascending):

``predictor(h, mlp_a, mlp_b, head_a=None, head_b=None, *, kept_units, kept_heads=0, eps=1e-6,
            out=None, workspace=None) -> (mlp_idx [K] int32, head_idx [Kh] int32 or None)``
    DejaVuLookaheadPredictor: h [B,d], mlp_a [d,r_m], mlp_b [r_m,Nb], head_a [d,r_h], head_b [r_h,H].
    ``out=(mlp_idx, head_idx)`` writes into preallocated int32 tensors.

``sparse_mlp(x, idx, *, activation, block_size=1, w_up, w_down_t, w_gate=None, b_up=None,
             b_down=None, residual=None, out=None, workspace=None) -> y [B,d]``
    DejaVuSparseMLP; activation in {"relu", "gelu", "silu_glu"}; same keywords as
    ``dejavu_trt.ops.reference.sparse_mlp``. ``residual`` [B,d] (may be ``out``) is added to the result
    in fp32 before the one rounding (the executor's fused residual add; not part of the op contract).

``head_sparse_attention(x, head_idx, position, w_q, w_k, w_v, w_o_t, b_q, b_k, b_v, b_o, rope_cos,
                        rope_sin, k_cache, v_cache, *, num_heads, num_kv_heads, head_dim, rotary, scale,
                        kv_policy="dense", residual=None, out=None, workspace=None) -> (y, k_cache, v_cache)``
    DejaVuHeadSparseAttention; the caches [B,Hkv,T,hd] are updated IN PLACE and returned (the
    reference returns updated copies). Biases may be None (zero); rope tables may be None if rotary=0.
    ``residual`` as for ``sparse_mlp``.

``norm(x, weight, bias=None, *, kind, eps, out=None) -> y``
    Row LayerNorm ("layernorm") or HF-style RMSNorm ("rmsnorm") over the last dimension, for the
    executor (torch's kernel is slow for one short row); ``out`` may be ``x``.

Norm folding (the CUDA executor's; not part of the op contract): ``row_stats(z) -> stats`` gives the
[rows, stats_blocks(d), 2] float32 (mean, M2) of each 64-column block of z. ``sparse_mlp`` and
``head_sparse_attention`` take ``x_stats=stats, norm_kind=..., norm_eps=...`` to run on
norm(x) without its affine part (the caller folds the norm's weight and bias into the op's weights,
``fold_norm``), and ``y_stats=`` (a tensor from ``empty_stats``) to receive the statistics of y.

The decode step's ends (the CUDA executor's; not part of the op contract): ``embed(tokens, positions, emb,
pos_emb=None, *, pos_offset=0)`` is the embedding in one launch, and ``greedy_tail(logits, tokens,
position=None, logits_out=None)`` the fp32 logits, their argmax and the position increment in one launch.

``set_mlp_grid_slack(sms) -> previous``: the fused sm_90 MLP's grid sized for ``sms`` fewer SMs, leaving
room for the predictor's top-k CTAs on its side stream (process-wide; batch 1's timed step choice in the
executor uses it).

``set_indices_ready(ready) -> previous``: the caller's promise that the index inputs of the MLP and attention
calls it enqueues were written at least two kernels earlier (or on a stream joined before the kernel just
before); the QKV projection and the fused MLP then read indices and first weight rows before their
programmatic-launch wait. Process-wide; the CUDA executor sets it while it enqueues its decode step.

Limits (checked, ValueError otherwise): 1 <= B <= 16; d % 8 == 0; head_dim in {64, 128, 256};
predictor ranks <= 2048. ``*_workspace_size`` give the byte counts.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = [
    "available", "load_library", "open_library", "library_path", "KernelsUnavailable",
    "predictor", "sparse_mlp", "head_sparse_attention", "norm", "row_stats", "empty_stats", "fold_norm",
    "embed", "greedy_tail",
    "predictor_workspace_size", "sparse_mlp_workspace_size", "head_attention_workspace_size", "set_mlp_grid_slack",
    "set_indices_ready",
]

_REPO = Path(__file__).resolve().parents[2]
_DEFAULT_LIB = _REPO / "plugins" / "build" / "libdejavu_kernels.so"
# What TensorRT loads: the IPluginV3 creators, built beside the kernels library when TensorRT is found
# (plugins/CMakeLists.txt); the kernels library alone registers no plugin.
TRT_PLUGIN_LIBRARY = "libdejavu_trt_plugins.so"
_ACT = {"relu": 0, "gelu": 1, "silu_glu": 2}
_POLICY = {"dense": 0, "active": 1}
_NORM = {"layernorm": 0, "rmsnorm": 1}
ABI_VERSION = 7  # DJV_ABI_VERSION of plugins/common/dejavu_kernels.h
_lib = None
_ws_cache: dict = {}
# Buffers the cache has replaced by larger ones. A CUDA graph captured while one was cached still writes to it
# on every replay (an Engine keeps one executor, and its graph, per batch size), so it must never go back to
# the allocator: it is kept for the life of the process.
_ws_retired: list = []


class KernelsUnavailable(RuntimeError):
    """libdejavu_kernels could not be found or loaded."""


def library_path() -> Path:
    env = os.environ.get("DEJAVU_KERNELS_LIB")
    return Path(env) if env else _DEFAULT_LIB


def load_library():
    """The library at `library_path()`, loaded once per process."""
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    if not path.exists():
        raise KernelsUnavailable(
            f"libdejavu_kernels not found at {path}; build it with `python -m dejavu_trt.kernels.build` "
            "(needs nvcc and cmake) or point DEJAVU_KERNELS_LIB at it")
    _lib = open_library(path)
    return _lib


def open_library(path: str | Path) -> ctypes.CDLL:
    """Load libdejavu_kernels from `path` with its C signatures declared (not cached)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # e.g. no CUDA runtime on this machine
        raise KernelsUnavailable(f"cannot load {path}: {e}") from e
    P, I, F, Z = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
    lib.djv_abi_version.restype = I
    lib.djv_status_string.restype = ctypes.c_char_p
    lib.djv_status_string.argtypes = [I]
    lib.djv_predictor_workspace_size.restype = Z
    lib.djv_predictor_workspace_size.argtypes = [I] * 6
    lib.djv_lookahead_predictor.restype = I
    lib.djv_lookahead_predictor.argtypes = [P] * 8 + [I] * 8 + [F, I, P, Z, P]
    lib.djv_sparse_mlp_workspace_size.restype = Z
    lib.djv_sparse_mlp_workspace_size.argtypes = [I] * 6
    lib.djv_sparse_mlp.restype = I
    lib.djv_sparse_mlp.argtypes = [P] * 9 + [I] * 7 + [P, Z, P]
    lib.djv_head_attention_workspace_size.restype = Z
    lib.djv_head_attention_workspace_size.argtypes = [I] * 8
    lib.djv_head_sparse_attention.restype = I
    lib.djv_head_sparse_attention.argtypes = [P] * 17 + [I] * 8 + [F, I, I, P, Z, P]
    lib.djv_norm.restype = I
    lib.djv_norm.argtypes = [P] * 4 + [I] * 3 + [F, I, P]
    lib.djv_stats_blocks.restype = I
    lib.djv_stats_blocks.argtypes = [I]
    lib.djv_row_stats.restype = I
    lib.djv_row_stats.argtypes = [P, P, I, I, I, P]
    lib.djv_sparse_mlp_folded.restype = I
    lib.djv_sparse_mlp_folded.argtypes = [P] * 9 + [I] * 6 + [P, I, F, P] + [I, P, Z, P]
    lib.djv_head_sparse_attention_folded.restype = I
    lib.djv_head_sparse_attention_folded.argtypes = [P] * 17 + [I] * 8 + [F, I] + [P, I, F, P] + [I, P, Z, P]
    if lib.djv_abi_version() != ABI_VERSION:
        raise KernelsUnavailable(f"{path}: C ABI version {lib.djv_abi_version()}, expected {ABI_VERSION}; rebuild it "
                                 "with `python -m dejavu_trt.kernels.build`")
    lib.djv_set_mlp_grid_slack.restype = I  # ABI 5
    lib.djv_set_mlp_grid_slack.argtypes = [I]
    lib.djv_embed.restype = I  # ABI 6
    lib.djv_embed.argtypes = [P] * 4 + [I, P] + [I] * 5 + [P]
    lib.djv_greedy_tail_workspace_size.restype = Z
    lib.djv_greedy_tail_workspace_size.argtypes = [I, I]
    lib.djv_greedy_tail.restype = I
    lib.djv_greedy_tail.argtypes = [P] * 4 + [I] * 3 + [P, Z, P]
    lib.djv_set_indices_ready.restype = I  # ABI 7
    lib.djv_set_indices_ready.argtypes = [I]
    return lib


def available() -> bool:
    try:
        load_library()
        return True
    except KernelsUnavailable:
        return False


def _dtype_code(t):
    import torch
    if t.dtype == torch.float16:
        return 0
    if t.dtype == torch.bfloat16:
        return 1
    raise ValueError(f"dtype {t.dtype} not supported by the kernels (float16 or bfloat16)")


def _ptr(t):
    if t is None:
        return None
    if not t.is_cuda:
        raise ValueError("kernel inputs must be CUDA tensors")
    if not t.is_contiguous():
        raise ValueError("kernel inputs must be contiguous")
    return ctypes.c_void_p(t.data_ptr())


def _check(status: int, op: str):
    if status != 0:
        msg = _lib.djv_status_string(status).decode()
        raise ValueError(f"{op}: {msg} (status {status})") if status < 0 else RuntimeError(f"{op}: CUDA error: {msg}")


def _stream():
    import torch
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _workspace(op: str, nbytes: int, device, given):
    """A zero-filled uint8 buffer of >= nbytes; cached per (device, op) and grown on demand (the buffer it
    replaces stays allocated: graphs captured with it still use it)."""
    import torch
    if given is not None:
        if given.numel() < nbytes or given.dtype != torch.uint8 or not given.is_cuda:
            raise ValueError(f"{op}: workspace must be a CUDA uint8 tensor of >= {nbytes} bytes")
        return given
    key = (device.index if device.index is not None else torch.cuda.current_device(), op)
    buf = _ws_cache.get(key)
    if buf is None or buf.numel() < nbytes:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{op}: workspace must be allocated before graph capture; call once eagerly first "
                               "or pass workspace=")
        if buf is not None:
            _ws_retired.append(buf)
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # counters must start at zero
        _ws_cache[key] = buf
    return buf


def set_mlp_grid_slack(sms: int) -> int:
    """Size the fused MLP's grid (sm_90, batch <= 4) for `sms` fewer SMs than the device has, leaving room for
    the predictor's CTAs on its side stream. Process-wide and read when a call is enqueued: a captured CUDA
    graph keeps the grid it was captured with. Returns the previous value."""
    prev = load_library().djv_set_mlp_grid_slack(int(sms))
    if prev < 0:
        raise ValueError(f"MLP grid slack {sms}: must be between 0 and half the device's SM count")
    return prev


def set_indices_ready(ready: bool) -> bool:
    """Promise that the index inputs of the MLP and attention calls enqueued from now on were written at least
    two kernels before each call on its stream (or on a stream joined before the kernel just before it), so
    their first kernels may read them, and their first weight rows, before waiting for the kernel before.
    Process-wide and read when a call is enqueued: a captured CUDA graph keeps what it captured. Results are
    bit-identical either way. Returns the previous setting."""
    return bool(load_library().djv_set_indices_ready(1 if ready else 0))


def predictor_workspace_size(B, d, r_m, Nb, r_h=0, H=0) -> int:
    return int(load_library().djv_predictor_workspace_size(B, d, r_m, Nb, r_h, H))


def sparse_mlp_workspace_size(B, d, N, K, block_size, activation) -> int:
    return int(load_library().djv_sparse_mlp_workspace_size(B, d, N, K, block_size, _ACT[activation]))


def head_attention_workspace_size(B, d, H, Hkv, hd, Kh, T, kv_policy) -> int:
    return int(load_library().djv_head_attention_workspace_size(B, d, H, Hkv, hd, Kh, T, _POLICY[kv_policy]))


def predictor(h, mlp_a, mlp_b, head_a=None, head_b=None, *, kept_units: int, kept_heads: int = 0,
              eps: float = 1e-6, out=None, workspace=None, mlp_scores=None):
    import torch
    lib = load_library()
    B, d = h.shape
    r_m, Nb = mlp_b.shape
    heads = head_a is not None
    r_h, H = (head_b.shape if heads else (0, 0))
    dev = h.device
    if out is None:
        mlp_idx = torch.empty(kept_units, dtype=torch.int32, device=dev)
        head_idx = torch.empty(kept_heads, dtype=torch.int32, device=dev) if heads else None
    else:
        mlp_idx, head_idx = out
    ws = _workspace("predictor", lib.djv_predictor_workspace_size(B, d, r_m, Nb, r_h, H), dev, workspace)
    st = lib.djv_lookahead_predictor(
        _ptr(h), _ptr(mlp_a), _ptr(mlp_b), _ptr(head_a), _ptr(head_b), _ptr(mlp_idx), _ptr(head_idx),
        _ptr(mlp_scores), B, d, r_m, Nb, kept_units, r_h, H, kept_heads, eps, _dtype_code(h),
        _ptr(ws), ws.numel(), _stream())
    _check(st, "predictor")
    return mlp_idx, head_idx


def embed(tokens, positions, emb, pos_emb=None, *, pos_offset: int = 0, out=None):
    """y [rows,d] = emb[tokens] + pos_emb[positions + pos_offset] in one launch (the decode step's embedding);
    tokens int64 [rows], positions int32 [rows] (unused without pos_emb). Ids outside a table give NaN rows."""
    import torch
    lib = load_library()
    if tokens.dtype != torch.int64 or tokens.dim() != 1:
        raise ValueError("embed: tokens must be a 1-D int64 tensor")
    if pos_emb is not None and (positions is None or positions.dtype != torch.int32 or positions.shape != tokens.shape):
        raise ValueError("embed: positions must be an int32 tensor shaped like tokens")
    if pos_emb is not None and pos_emb.dtype != emb.dtype:
        raise ValueError("embed: emb and pos_emb must share a dtype")
    V, d = emb.shape
    y = out if out is not None else torch.empty(tokens.shape[0], d, dtype=emb.dtype, device=emb.device)
    st = lib.djv_embed(_ptr(tokens), _ptr(positions) if pos_emb is not None else None, _ptr(emb), _ptr(pos_emb),
                       int(pos_offset), _ptr(y), tokens.shape[0], d, V,
                       pos_emb.shape[0] if pos_emb is not None else 0, _dtype_code(emb), _stream())
    _check(st, "embed")
    return y


def greedy_tail(logits, tokens, position=None, logits_out=None, workspace=None):
    """One launch after the LM head: logits_out (float32, may be None) = logits, tokens (int64 [B]) = their
    argmax (torch.argmax's order: NaN first, then the lower index), position (int32 [B], may be None) += 1."""
    import torch
    lib = load_library()
    B, V = logits.shape
    if tokens.dtype != torch.int64 or tokens.shape != (B,):
        raise ValueError(f"greedy_tail: tokens must be int64 [{B}]")
    if position is not None and (position.dtype != torch.int32 or position.shape != (B,)):
        raise ValueError(f"greedy_tail: position must be int32 [{B}]")
    if logits_out is not None and (logits_out.dtype != torch.float32 or logits_out.shape != (B, V)):
        raise ValueError(f"greedy_tail: logits_out must be float32 [{B}, {V}]")
    ws = _workspace("greedy_tail", lib.djv_greedy_tail_workspace_size(B, V), logits.device, workspace)
    st = lib.djv_greedy_tail(_ptr(logits), _ptr(logits_out), _ptr(tokens), _ptr(position), B, V,
                             _dtype_code(logits), _ptr(ws), ws.numel(), _stream())
    _check(st, "greedy_tail")
    return tokens


def _fold_args(x_stats, norm_kind, norm_eps, y_stats):
    if x_stats is not None and norm_kind not in _NORM:
        raise ValueError(f"x_stats needs norm_kind in {sorted(_NORM)}, got {norm_kind!r}")
    for name, t in (("x_stats", x_stats), ("y_stats", y_stats)):
        if t is not None and t.dtype != __import__("torch").float32:
            raise ValueError(f"{name} must be float32 (from row_stats / empty_stats)")
    return _ptr(x_stats), _NORM.get(norm_kind, 0), float(norm_eps), _ptr(y_stats)


def stats_blocks(d: int) -> int:
    return int(load_library().djv_stats_blocks(d))


def empty_stats(rows: int, d: int, device):
    import torch
    return torch.empty(rows, stats_blocks(d), 2, dtype=torch.float32, device=device)


def row_stats(z, out=None):
    """(mean, M2) of each 64-column block of each row of z [rows, d] -> [rows, stats_blocks(d), 2] float32."""
    lib = load_library()
    d = z.shape[-1]
    rows = z.numel() // d
    st = empty_stats(rows, d, z.device) if out is None else out
    _check(lib.djv_row_stats(_ptr(z), _ptr(st), rows, d, _dtype_code(z), _stream()), "row_stats")
    return st


def fold_norm(weight, norm_weight, norm_bias=None, bias=None):
    """Fold a norm's affine part into the linear layer after it: W' = W diag(g), b' = b + W beta (fp32,
    rounded once to W's dtype). weight [N, d]; returns (W', b' or None)."""
    wf = weight.float()
    folded = (wf * norm_weight.float()[None, :]).to(weight.dtype)
    b = None
    if norm_bias is not None or bias is not None:
        b = bias.float() if bias is not None else 0.0
        if norm_bias is not None:
            b = b + wf @ norm_bias.float()
        b = b.to(weight.dtype)
    return folded.contiguous(), b


def sparse_mlp(x, idx, *, activation: str, block_size: int = 1, w_up, w_down_t, w_gate=None, b_up=None,
               b_down=None, residual=None, out=None, workspace=None, x_stats=None, norm_kind=None,
               norm_eps: float = 0.0, y_stats=None):
    """y = MLP(x) over the active blocks idx, plus `residual` when given (fp32 sum, one rounding).
    With x_stats: MLP(norm(x)) with the norm's affine part folded into the weights (see the module doc)."""
    import torch
    lib = load_library()
    B, d = x.shape
    N = w_up.shape[0]
    K = idx.shape[0]
    act = _ACT[activation]
    y = torch.empty_like(x) if out is None else out
    ws = _workspace("sparse_mlp", lib.djv_sparse_mlp_workspace_size(B, d, N, K, block_size, act), x.device,
                    workspace)
    st = lib.djv_sparse_mlp_folded(_ptr(x), _ptr(idx), _ptr(w_gate), _ptr(w_up), _ptr(b_up), _ptr(w_down_t),
                                   _ptr(b_down), _ptr(residual), _ptr(y), B, d, N, K, block_size, act,
                                   *_fold_args(x_stats, norm_kind, norm_eps, y_stats), _dtype_code(x), _ptr(ws),
                                   ws.numel(), _stream())
    _check(st, "sparse_mlp")
    return y


def head_sparse_attention(x, head_idx, position, w_q, w_k, w_v, w_o_t, b_q, b_k, b_v, b_o, rope_cos, rope_sin,
                          k_cache, v_cache, *, num_heads: int, num_kv_heads: int, head_dim: int, rotary: int,
                          scale: float, kv_policy: str = "dense", residual=None, out=None, workspace=None,
                          x_stats=None, norm_kind=None, norm_eps: float = 0.0, y_stats=None):
    import torch
    lib = load_library()
    B, d = x.shape
    T = k_cache.shape[2]
    Kh = head_idx.shape[0]
    pol = _POLICY[kv_policy]
    y = torch.empty_like(x) if out is None else out
    ws = _workspace("head_attention", lib.djv_head_attention_workspace_size(
        B, d, num_heads, num_kv_heads, head_dim, Kh, T, pol), x.device, workspace)
    st = lib.djv_head_sparse_attention_folded(
        _ptr(x), _ptr(head_idx), _ptr(position), _ptr(w_q), _ptr(w_k), _ptr(w_v), _ptr(w_o_t), _ptr(b_q),
        _ptr(b_k), _ptr(b_v), _ptr(b_o), _ptr(rope_cos) if rotary else None, _ptr(rope_sin) if rotary else None,
        _ptr(k_cache), _ptr(v_cache), _ptr(residual), _ptr(y), B, d, num_heads, num_kv_heads, head_dim, Kh, T, int(rotary),
        float(scale), pol, *_fold_args(x_stats, norm_kind, norm_eps, y_stats), _dtype_code(x), _ptr(ws), ws.numel(),
        _stream())
    _check(st, "head_sparse_attention")
    return y, k_cache, v_cache


def norm(x, weight, bias=None, *, kind: str, eps: float, out=None):
    """LayerNorm / RMSNorm over the last dimension of x (any leading shape, contiguous)."""
    import torch
    lib = load_library()
    d = x.shape[-1]
    rows = x.numel() // d
    y = torch.empty_like(x) if out is None else out
    st = lib.djv_norm(_ptr(x), _ptr(weight), _ptr(bias), _ptr(y), rows, d, _NORM[kind], eps, _dtype_code(x), _stream())
    _check(st, "norm")
    return y
