"""The decode step's own kernels (embedding, greedy tail) against torch.

Fresh random inputs each run; outputs poisoned before each call. The embedding and the tail are exact
(one fp32 add rounded once, a copy, an argmax), so they are compared bit for bit.
"""
import pytest
import torch

from dejavu_trt import kernels

DTYPES = [torch.float16, torch.bfloat16]


def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


# ------------------------------------------------------------------------------------------ embedding
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("rows,V,d,Tp,offset", [(1, 512, 256, 66, 2), (5, 37, 8, 9, 0), (3, 1000, 1032, 0, 0),
                                                (16, 50272, 5120, 2050, 2), (2, 49152, 576, 0, 0)])
def test_embed_matches_torch(rows, V, d, Tp, offset, dtype):
    emb = rand(V, d, dtype=dtype)
    pemb = rand(Tp, d, dtype=dtype) if Tp else None
    tok = torch.randint(0, V, (rows,), device="cuda")
    tok[0] = V - 1  # the table's last row
    pos = torch.randint(0, max(1, Tp - offset), (rows,), device="cuda", dtype=torch.int32)
    out = torch.full((rows, d), float("nan"), device="cuda", dtype=dtype)
    kernels.embed(tok, pos, emb, pemb, pos_offset=offset, out=out)
    want = emb[tok] if pemb is None else emb[tok] + pemb[pos.long() + offset]
    assert torch.equal(out, want)


def test_embed_out_of_range_gives_nan_rows():
    emb, pemb = rand(10, 16, dtype=torch.float16), rand(8, 16, dtype=torch.float16)
    tok = torch.tensor([3, 10, -1, 4], device="cuda")
    pos = torch.tensor([0, 0, 0, 6], device="cuda", dtype=torch.int32)  # 6 + offset 2 = 8: past the table
    out = kernels.embed(tok, pos, emb, pemb, pos_offset=2)
    assert torch.equal(out[0], emb[3] + pemb[2])
    assert torch.isnan(out[1:]).all()


def test_embed_rejects_bad_arguments():
    emb = rand(10, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="int64"):
        kernels.embed(torch.tensor([1], device="cuda", dtype=torch.int32), None, emb)
    with pytest.raises(ValueError, match="int32"):
        kernels.embed(torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda"), emb, emb)
    with pytest.raises(ValueError, match="shape"):
        kernels.embed(torch.tensor([1], device="cuda"), None, rand(10, 12, dtype=torch.float16))


# ------------------------------------------------------------------------------------------ greedy tail
def _tail(logits, position=True):
    B, V = logits.shape
    out = torch.full((B, V), float("nan"), device="cuda")
    tok = torch.full((B,), -5, device="cuda", dtype=torch.long)
    pos = torch.randint(0, 100, (B,), device="cuda", dtype=torch.int32) if position else None
    pos0 = pos.clone() if position else None
    kernels.greedy_tail(logits, tok, pos, logits_out=out)
    return out, tok, pos, pos0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,V", [(1, 1), (1, 7), (2, 2047), (3, 2048), (1, 2049), (1, 50272), (4, 49155),
                                 (16, 32001)])
def test_greedy_tail_matches_torch(B, V, dtype):
    logits = rand(B, V, dtype=dtype, scale=4.0)
    out, tok, pos, pos0 = _tail(logits)
    assert torch.equal(out, logits.float())
    assert torch.equal(tok, logits.float().argmax(-1))
    assert torch.equal(pos, pos0 + 1)


def test_greedy_tail_ties_nan_and_infinities_follow_torch_argmax():
    V = 9000
    rows = torch.full((6, V), -1.0, device="cuda", dtype=torch.float16)
    rows[0, [4321, 77, 8999]] = 3.0            # ties in three CTAs' chunks: the lowest index
    rows[1, [5000, 6000]] = float("nan")      # NaN beats every number: the first NaN
    rows[1, 7000] = float("inf")
    rows[2] = float("-inf")                   # all -inf: index 0
    rows[3, 8999] = float("inf")              # the very last element
    rows[4, 2048] = 2.0                       # the first element of the second CTA
    rows[5, [2047, 2048]] = 2.0               # a tie across the first chunk boundary
    out, tok, pos, _ = _tail(rows, position=False)
    assert pos is None
    assert tok.tolist() == [77, 5000, 0, 8999, 2048, 2047]
    assert torch.equal(tok, rows.float().argmax(-1))
    assert torch.equal(out.isnan(), rows.isnan()) and torch.equal(out.nan_to_num(), rows.float().nan_to_num())


def test_greedy_tail_in_a_cuda_graph_repeats():
    """Replayed many times in one graph, the counters reset each call and each replay sees the new logits."""
    B, V = 2, 50272
    logits = rand(B, V, dtype=torch.float16)
    tok = torch.zeros(B, device="cuda", dtype=torch.long)
    pos = torch.zeros(B, device="cuda", dtype=torch.int32)
    out = torch.empty(B, V, device="cuda")
    kernels.greedy_tail(logits, tok, pos, logits_out=out)  # workspace allocated outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernels.greedy_tail(logits, tok, pos, logits_out=out)
    for i in range(20):
        logits.copy_(rand(B, V, dtype=torch.float16))
        g.replay()
        assert torch.equal(tok, logits.float().argmax(-1))
        assert pos.tolist() == [i + 2] * B


def test_greedy_tail_rejects_bad_arguments():
    logits = rand(2, 10, dtype=torch.float16)
    with pytest.raises(ValueError, match="int64"):
        kernels.greedy_tail(logits, torch.zeros(2, device="cuda", dtype=torch.int32))
    with pytest.raises(ValueError, match="position"):
        kernels.greedy_tail(logits, torch.zeros(2, device="cuda", dtype=torch.long),
                            torch.zeros(2, device="cuda", dtype=torch.long))
    with pytest.raises(ValueError, match="float32"):
        kernels.greedy_tail(logits, torch.zeros(2, device="cuda", dtype=torch.long),
                            logits_out=torch.zeros(2, 10, device="cuda", dtype=torch.float16))
