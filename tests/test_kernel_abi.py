"""The kernels' host-side C ABI, on a machine without a GPU: argument checks and workspace sizes.

libdejavu_kernels is built from plugins/ (nvcc + cmake; no GPU needed). A call whose arguments pass every
check goes on to launch and fails there with a CUDA error (a positive status), because there is no device;
a call the ABI rejects returns a negative DJV_E_* status before touching CUDA. The device pointers below
are fake, which is only safe because nothing can launch: with a GPU present these tests skip.
"""
import shutil

import pytest

from dejavu_trt import kernels

DJV_E_SHAPE, DJV_E_WORKSPACE = -1, -3
FAKE = 0x10000  # a 16-byte-aligned non-null "device pointer"; never dereferenced without a device


def _gpu_present() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


pytestmark = [
    pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cmake") is None,
                       reason="building libdejavu_kernels needs nvcc and cmake"),
    pytest.mark.skipif(_gpu_present(), reason="uses fake device pointers; on a GPU machine see tests/gpu"),
]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from dejavu_trt.kernels.build import build
    return kernels.open_library(build(tmp_path_factory.mktemp("kernels-build"), jobs=2))


MLP_SHAPES = [(5120, 20480, 5120, 0), (576, 1536, 768, 2), (4096, 11008, 2752, 2), (200, 37, 1, 1)]  # d, N, K, act


@pytest.mark.parametrize("d,N,K,act", MLP_SHAPES)
def test_mlp_workspace_for_max_batch_serves_every_batch(lib, d, N, K, act):
    """TensorRT sizes the workspace once, for the profile's maximum batch; batch <= 4 and batch > 4 use
    different kernels and scratch, so that size must satisfy the check of every smaller batch."""
    ws16 = lib.djv_sparse_mlp_workspace_size(16, d, N, K, 1, act)
    sizes = [lib.djv_sparse_mlp_workspace_size(b, d, N, K, 1, act) for b in range(1, 17)]
    assert sizes == sorted(sizes) and sizes[-1] == ws16
    for B in range(1, 17):
        st = lib.djv_sparse_mlp(FAKE, FAKE, FAKE, FAKE, None, FAKE, None, None, FAKE, B, d, N, K, 1, act, 0, FAKE, ws16,
                                None)
        assert st > 0, f"batch {B}: status {st} ({lib.djv_status_string(st).decode()}), expected a launch error"
    st = lib.djv_sparse_mlp(FAKE, FAKE, FAKE, FAKE, None, FAKE, None, None, FAKE, 1, d, N, K, 1, act, 0, FAKE, 4096, None)
    assert st == DJV_E_WORKSPACE  # and a workspace that is too small is refused before any launch


@pytest.mark.parametrize("kv_policy", [0, 1])
def test_attention_workspace_for_max_batch_serves_every_batch(lib, kv_policy):
    d, H, Hkv, hd, Kh, T = 5120, 40, 40, 128, 8, 2048
    ws16 = lib.djv_head_attention_workspace_size(16, d, H, Hkv, hd, Kh, T, kv_policy)
    for B in range(1, 17):
        st = lib.djv_head_sparse_attention(FAKE, FAKE, FAKE, FAKE, FAKE, FAKE, FAKE, None, None, None, None, FAKE,
                                           FAKE, FAKE, FAKE, None, FAKE, B, d, H, Hkv, hd, Kh, T, 1, 0.088, kv_policy, 0,
                                           FAKE, ws16, None)
        assert st > 0, f"batch {B}: status {st} ({lib.djv_status_string(st).decode()})"


@pytest.mark.parametrize("B,d,r_m,Nb,K,r_h,H,Kh", [
    (1, 576, 64, 1536, 768, 32, 9, 6),  # SmolLM2-135M: 9 heads (was rejected as "bad shape")
    (3, 200, 7, 33, 5, 5, 9, 1),        # odd ranks and unit counts
    (16, 5120, 128, 20480, 5120, 64, 40, 8),
])
def test_predictor_accepts_model_shapes(lib, B, d, r_m, Nb, K, r_h, H, Kh):
    ws = lib.djv_predictor_workspace_size(B, d, r_m, Nb, r_h, H)
    st = lib.djv_lookahead_predictor(FAKE, FAKE, FAKE, FAKE, FAKE, FAKE, FAKE, None, B, d, r_m, Nb, K, r_h, H, Kh,
                                     1e-5, 0, FAKE, ws, None)
    assert st > 0, f"status {st} ({lib.djv_status_string(st).decode()}), expected a launch error"


@pytest.mark.parametrize("B,Nb,K,H,Kh", [(17, 64, 8, 4, 1), (1, 64, 65, 4, 1), (1, 64, 8, 4, 5), (1, 64, 0, 4, 1)])
def test_predictor_rejects_bad_shapes(lib, B, Nb, K, H, Kh):
    ws = lib.djv_predictor_workspace_size(min(B, 16), 64, 8, Nb, 8, H)
    st = lib.djv_lookahead_predictor(FAKE, FAKE, FAKE, FAKE, FAKE, FAKE, FAKE, None, B, 64, 8, Nb, K, 8, H, Kh,
                                     1e-5, 0, FAKE, ws, None)
    assert st == DJV_E_SHAPE


@pytest.mark.parametrize("rows,d,kind,bias,want", [
    (1, 5120, 0, FAKE, "launch"), (16, 576, 1, None, "launch"), (1, 16384, 0, None, "launch"),
    (1, 12, 0, None, DJV_E_SHAPE), (1, 16392, 1, None, DJV_E_SHAPE), (0, 64, 0, None, DJV_E_SHAPE),
    (1, 64, 2, None, -2), (1, 64, 1, FAKE, -4),  # unknown kind; RMSNorm has no bias
])
def test_norm_argument_checks(lib, rows, d, kind, bias, want):
    st = lib.djv_norm(FAKE, FAKE, bias, FAKE, rows, d, kind, 1e-5, 0, None)
    if want == "launch":
        assert st > 0, f"status {st} ({lib.djv_status_string(st).decode()}), expected a launch error"
    else:
        assert st == want


def test_stats_blocks_row_stride(lib):
    # 64-column blocks, row stride rounded up to an even count (rows start 16-byte aligned for float4 reads)
    assert [lib.djv_stats_blocks(d) for d in (8, 64, 136, 576, 5120, 16384)] == [2, 2, 4, 10, 80, 256]


FAKE2 = FAKE + 0x1000  # a second fake pointer (x_stats and y_stats must differ)


@pytest.mark.parametrize("d,x_stats,kind,y_stats,want", [
    (5120, FAKE2, 0, None, "launch"), (576, FAKE2, 1, FAKE2 + 0x1000, "launch"), (5120, None, 7, FAKE2, "launch"),
    (5120, FAKE2, 7, None, -2),            # unknown norm kind (only checked when x_stats is given)
    (5120, FAKE2, 0, FAKE2, -4),           # y_stats would overwrite x_stats
    (5120, FAKE2 + 8, 0, None, -4),        # statistics must be 16-byte aligned
    (16392, FAKE2, 0, None, DJV_E_SHAPE),  # statistics cover d <= 16384
])
def test_folded_call_argument_checks(lib, d, x_stats, kind, y_stats, want):
    """djv_sparse_mlp_folded / djv_head_sparse_attention_folded check the norm-folding arguments before any
    launch; with valid ones they go on to launch (and fail there: no device)."""
    N, K = 4096, 512
    ws = lib.djv_sparse_mlp_workspace_size(4, d, N, K, 1, 0)
    st = lib.djv_sparse_mlp_folded(FAKE, FAKE, None, FAKE, None, FAKE, None, None, FAKE, 1, d, N, K, 1, 0, x_stats,
                                   kind, 1e-5, y_stats, 0, FAKE, ws, None)
    H, hd, Kh, T = 8, 64, 2, 64
    wsa = lib.djv_head_attention_workspace_size(1, d, H, H, hd, Kh, T, 1)
    sa = lib.djv_head_sparse_attention_folded(FAKE, FAKE, FAKE, FAKE, FAKE, FAKE, FAKE, None, None, None, None, None,
                                              None, FAKE, FAKE, None, FAKE, 1, d, H, H, hd, Kh, T, 0, 0.125, 1, x_stats,
                                              kind, 1e-5, y_stats, 0, FAKE, wsa, None)
    for name, s in (("mlp", st), ("attention", sa)):
        if want == "launch":
            assert s > 0, f"{name}: status {s} ({lib.djv_status_string(s).decode()}), expected a launch error"
        else:
            assert s == want, name


@pytest.mark.parametrize("rows,d,want", [(1, 5120, "launch"), (3, 136, "launch"), (1, 12, DJV_E_SHAPE),
                                         (1, 16392, DJV_E_SHAPE), (0, 64, DJV_E_SHAPE)])
def test_row_stats_argument_checks(lib, rows, d, want):
    st = lib.djv_row_stats(FAKE, FAKE2, rows, d, 0, None)
    if want == "launch":
        assert st > 0
    else:
        assert st == want


def test_mlp_grid_slack_setter(lib):
    """djv_set_mlp_grid_slack returns the previous value and rejects values outside [0, SM count / 2]. A slack
    never makes an MLP call need more workspace; without a device the fused sm_90 plan does not apply, so the
    sizes are equal here (tests/gpu/test_kernels.py checks that the slack reaches the fused kernel)."""
    before = lib.djv_set_mlp_grid_slack(2)
    assert before >= 0
    try:
        assert lib.djv_set_mlp_grid_slack(-1) == DJV_E_SHAPE
        assert lib.djv_set_mlp_grid_slack(10_000) == DJV_E_SHAPE
        with_slack = lib.djv_sparse_mlp_workspace_size(1, 5120, 20480, 5120, 1, 0)
        assert lib.djv_set_mlp_grid_slack(0) == 2
        assert 0 < with_slack <= lib.djv_sparse_mlp_workspace_size(1, 5120, 20480, 5120, 1, 0)
    finally:
        lib.djv_set_mlp_grid_slack(before)


@pytest.mark.parametrize("rows,d,pos_emb,positions,want", [
    (1, 5120, FAKE, FAKE, "launch"), (16, 576, None, None, "launch"),
    (1, 12, None, None, DJV_E_SHAPE), (0, 64, None, None, DJV_E_SHAPE),
    (1, 64, FAKE, None, -4),            # a position table needs positions
    (1, 64, FAKE + 8, FAKE, -4),        # tables must be 16-byte aligned
])
def test_embed_argument_checks(lib, rows, d, pos_emb, positions, want):
    st = lib.djv_embed(FAKE, positions, FAKE, pos_emb, 2, FAKE2, rows, d, 50272, 2050, 0, None)
    if want == "launch":
        assert st > 0
    else:
        assert st == want


def test_greedy_tail_argument_checks(lib):
    need = lib.djv_greedy_tail_workspace_size(4, 50272)
    assert need > lib.djv_greedy_tail_workspace_size(1, 50272) > 0
    assert lib.djv_greedy_tail(FAKE, None, FAKE2, None, 4, 50272, 0, FAKE, need, None) > 0  # launches (and fails)
    assert lib.djv_greedy_tail(FAKE, None, FAKE2, None, 4, 50272, 0, FAKE, need - 1, None) == DJV_E_WORKSPACE
    assert lib.djv_greedy_tail(FAKE, None, FAKE2, None, 1, (1 << 21) + 1, 0, FAKE, 1 << 30, None) == DJV_E_SHAPE
    assert lib.djv_greedy_tail(FAKE, None, None, None, 1, 100, 0, FAKE, need, None) == -4  # no token output


def test_indices_ready_setter(lib):
    """djv_set_indices_ready (ABI 7) returns the previous setting, starts off (the kernels then assume the
    indices may come from the kernel just before) and accepts only 0 and 1."""
    before = lib.djv_set_indices_ready(1)
    try:
        assert before == 0
        assert lib.djv_set_indices_ready(2) == DJV_E_SHAPE
        assert lib.djv_set_indices_ready(-1) == DJV_E_SHAPE
        assert lib.djv_set_indices_ready(0) == 1
        assert lib.djv_set_indices_ready(0) == 0
    finally:
        lib.djv_set_indices_ready(before)
