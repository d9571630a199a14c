"""Independent torch references for docs/semantics.md (ht, ll, a2a), and the shared input
generators.

Written from docs/semantics.md only, in plain torch (no epx code): every rank regenerates every
rank's inputs from a seed, so each rank can compute what it must receive without communicating.

Number formats (docs/semantics.md §2.2, §3.3, docs/design.md §8): bf16 and float16
round-to-nearest-even (torch's .to(bfloat16) / .to(float16): float16 overflows to +-inf, keeps
subnormals; a NaN keeps its sign there, where epx writes 0x7E00); fp8 e4m3fn encoded here by
nearest-value search with ties to the even code, saturating at 448; float32 accumulations replayed
in float64 with one rounding to float32 per step (exact for the products of bf16 by float32 used
here).
"""

import math

import torch

# ---- random inputs -----------------------------------------------------------------------------

ROUTINGS = ("uniform", "skewed", "all_to_one", "empty_rank", "all_minus_one", "duplicates")


def generator(seed, *salt):
    g = torch.Generator()
    h = seed
    for s in salt:
        h = (h * 1000003 + (_stable_str_hash(s) if isinstance(s, str) else int(s))) % (1 << 62)
    g.manual_seed(h)
    return g


def _stable_str_hash(s):
    return sum((i + 1) * ord(c) for i, c in enumerate(s))


def routing(kind, num_tokens, top_k, num_experts, num_ranks, g, drop=0.1):
    """topk_idx [T, K] int64 in [-1, E) of the named kind (the adversarial routings
    of docs/semantics.md §4)."""
    T, K, E = num_tokens, top_k, num_experts
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64)
    if kind == "all_minus_one":
        return torch.full((T, K), -1, dtype=torch.int64)
    if kind == "all_to_one":
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = E // 2  # every token to one expert
        return idx
    if kind == "skewed":
        weights = torch.arange(E, 0, -1, dtype=torch.float64) ** 3
        kk = min(K, E)
        idx = torch.stack([torch.multinomial(weights, kk, replacement=False, generator=g)
                           for _ in range(T)])
        if kk < K:
            idx = torch.cat([idx, torch.full((T, K - kk), -1, dtype=torch.int64)], dim=1)
    elif kind == "empty_rank":
        L = E // num_ranks
        allowed = E - L if num_ranks > 1 else E  # nothing to the last rank's experts
        kk = min(K, allowed)
        idx = torch.rand(T, allowed, generator=g).argsort(dim=1)[:, :kk]
        if kk < K:
            idx = torch.cat([idx, torch.full((T, K - kk), -1, dtype=torch.int64)], dim=1)
    elif kind == "duplicates":
        idx = torch.randint(0, E, (T, K), generator=g)
        idx[:, -1] = idx[:, 0]  # the same expert twice in every row
    else:  # uniform: K distinct experts per token
        kk = min(K, E)
        idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :kk]
        if kk < K:
            idx = torch.cat([idx, torch.full((T, K - kk), -1, dtype=torch.int64)], dim=1)
    idx = idx.to(torch.int64)
    if drop > 0 and kind != "all_to_one":
        idx[torch.rand(T, K, generator=g) < drop] = -1
    return idx


def rand_bf16(shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def rand_bf16_wide(shape, g):
    """Random bf16 values of magnitude about 1 or about 2^24, half each: a float32 sum of them
    absorbs the small ones or not depending on the order (1 + 2^24 - 2^24), so a combine in
    another order than the semantics' gives other bits somewhere."""
    v = torch.randn(*shape, generator=g)
    return (v * torch.exp2(24.0 * torch.randint(0, 2, shape, generator=g))).to(torch.bfloat16)


def rand_weights(num_tokens, top_k, g):
    return torch.rand(num_tokens, top_k, generator=g, dtype=torch.float32) + 0.05


def rand_fp8_bits(shape, g):
    """Random e4m3 bit patterns without NaN (0x7F / 0xFF) as uint8."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int64)
    b[(b & 0x7F) == 0x7F] = 0x7E
    return b.to(torch.uint8)


# ---- number formats ----------------------------------------------------------------------------

def _e4m3_table():
    vals = []
    for code in range(0x7F):  # 0x00 .. 0x7E, ascending magnitude
        e, m = code >> 3, code & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


_E4M3 = _e4m3_table()


def e4m3_encode(v):
    """float32 tensor -> uint8 e4m3fn bits: nearest value, ties to the even code, saturated."""
    v = v.to(torch.float32)
    a = v.abs().to(torch.float64).flatten()
    hi = torch.searchsorted(_E4M3, a).clamp(max=len(_E4M3) - 1)
    lo = (hi - 1).clamp(min=0)
    d_hi = (_E4M3[hi] - a).abs()
    d_lo = (a - _E4M3[lo]).abs()
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = torch.where(pick_lo, lo, hi)
    code[a >= 448.0] = 0x7E
    sign = torch.signbit(v.flatten()).to(torch.int64) << 7
    return (code | sign).to(torch.uint8).reshape(v.shape)


def e4m3_decode(bits):
    bits = bits.to(torch.int64)
    mag = _E4M3[(bits & 0x7F).clamp(max=0x7E)]
    return torch.where((bits & 0x80) != 0, -mag, mag).to(torch.float32)


def round_up_pow2(s):
    """Smallest power of two >= s (float32, s > 0 normal)."""
    m, e = torch.frexp(s)
    return torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))


def quantize_fp8(x, round_scale):
    """docs/semantics.md §2.2: per token per 128 channels scale = max(amax, 1e-4) / 448 (optionally
    rounded up to a power of two), q = e4m3(x * (1 / scale)). x [T, H] bf16 -> (q uint8 [T, H],
    scales f32 [T, H/128])."""
    T, H = x.shape
    xf = x.to(torch.float32).reshape(T, H // 128, 128)
    amax = xf.abs().amax(dim=2).clamp(min=1e-4)
    scale = amax / torch.tensor(448.0, dtype=torch.float32)
    if round_scale:
        scale = round_up_pow2(scale)
    inv = torch.tensor(1.0, dtype=torch.float32) / scale
    q = e4m3_encode(xf * inv[:, :, None])
    return q.reshape(T, H), scale


def ue8m0_pack(scales):
    """Power-of-two f32 scales [..., G] -> int32 [..., ceil(G/4)], group g in byte g % 4."""
    G = scales.shape[-1]
    exp = (scales.view(torch.int32) >> 23) & 0xFF
    n = (G + 3) // 4
    padded = torch.zeros(*scales.shape[:-1], n * 4, dtype=torch.int64)
    padded[..., :G] = exp.to(torch.int64)
    p = padded.reshape(*scales.shape[:-1], n, 4)
    word = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16) | (p[..., 3] << 24)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)
    return word.to(torch.int32)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e2m1_encode(v):
    """float32 -> e2m1 code (sign bit 3): nearest grid value, ties to the even code, saturated."""
    a = v.abs().to(torch.float64).flatten()
    hi = torch.searchsorted(_E2M1, a).clamp(max=7)
    lo = (hi - 1).clamp(min=0)
    d_hi, d_lo = (_E2M1[hi] - a).abs(), (a - _E2M1[lo]).abs()
    code = torch.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)
    code[a >= 6.0] = 7
    return (code | (torch.signbit(v.flatten()).to(torch.int64) << 3)).reshape(v.shape)


def e2m1_decode(code):
    code = code.to(torch.int64)
    mag = _E2M1[code & 7].to(torch.float32)
    return torch.where((code & 8) != 0, -mag, mag)


def quantize_nvfp4(x, g):
    """docs/semantics.md §2.2 (NVFP4): per token per 16 values sf = e4m3((amax / 6) * g),
    q = e2m1(x * (g / sf)) (0 when sf is 0). x [T, H] bf16 -> (values u8 [T, H/2], element 2i in
    the low nibble; e4m3 scales u8 [T, H/16])."""
    T, H = x.shape
    xf = x.to(torch.float32).reshape(T, H // 16, 16)
    gs = torch.tensor(g, dtype=torch.float32)
    sf = e4m3_encode(xf.abs().amax(dim=2) / torch.tensor(6.0) * gs)
    sf_f = e4m3_decode(sf)
    inv = torch.where(sf_f == 0, torch.zeros_like(sf_f), gs / sf_f)
    code = e2m1_encode(xf * inv[:, :, None]).reshape(T, H // 2, 2)
    return (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8), sf


def nvfp4_ll_rows(recv_x, recv_scales):
    """The NVFP4 views an ll dispatch returns (docs/semantics.md §2.2; DeepEP's forks' layout):
    recv_x (RT, H/2, L) and recv_scales (32, 4, ceil(RT/128), 4, H/64, L), scale j of row r at
    (r % 32, r % 128 // 32, r // 128, j % 4, j // 4, l) -> (values u8 [L, RT, H/2], scales u8
    [L, RT, H/16]), read through the views' indexing (CPU copies)."""
    x = recv_x.cpu().permute(2, 0, 1)
    s = recv_scales.cpu().view(torch.uint8)
    L, RT = x.shape[0], x.shape[1]
    rm, rk = s.shape[2], s.shape[4]
    rows = s.permute(5, 2, 1, 0, 4, 3).reshape(L, rm * 128, rk * 4)
    return x, rows[:, :RT]


def f32_add(a, b):
    """float32 a + b with one rounding (a, b float32 tensors)."""
    return (a.to(torch.float64) + b.to(torch.float64)).to(torch.float32)


def f32_fma(a, b, c):
    """float32 fma(a, b, c): a * b is exact in float64 (b bf16, a f32), one rounding."""
    return (a.to(torch.float64) * b.to(torch.float64) + c.to(torch.float64)).to(torch.float32)


def f32_fma_exact(a, b, c):
    """float32 fma(a, b, c) with one rounding for any float32 a, b, c: a * b is exact in float64,
    the float64 sum's error is kept (TwoSum), and where the float64 sum lies exactly halfway
    between two floats (the only case a second rounding can go wrong) the error decides."""
    a, b, c = (v.to(torch.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.to(torch.float32)
    below = torch.nextafter(r, torch.full_like(r, -math.inf))
    lo = torch.where(r.to(torch.float64) <= s, r, below)
    hi = torch.nextafter(lo, torch.full_like(lo, math.inf))
    tie = (lo.to(torch.float64) + hi.to(torch.float64)) / 2 == s
    return torch.where(tie & (err > 0), hi, torch.where(tie & (err < 0), lo, r))


# ---- LogFMT-10 (docs/semantics.md §2.3.1): the ll combine's compressed rows -------------------
# Written from the spec in float32 torch ops, one rounding each (torch never fuses them).

LOGFMT_LOG2 = torch.tensor([math.log2(1 + k / 128) for k in range(128)],
                           dtype=torch.float64).to(torch.float32)
LOGFMT_EXP2 = torch.tensor([math.log(2) ** k / math.factorial(k) for k in range(10)],
                           dtype=torch.float64).to(torch.float32)


def logfmt_log2(mag):
    """log2b of bf16 magnitude bits (int64 tensor, 1 .. 0x7F7F) as float32: E + table[F]."""
    e, f = mag >> 7, mag & 0x7F
    high = torch.zeros_like(f)  # the highest set bit of f (subnormals)
    for b in range(7):
        high = torch.where((f >> b) & 1 == 1, torch.full_like(f, b), high)
    sub = e == 0
    f = torch.where(sub, (f << (7 - high)) & 0x7F, f)
    e = torch.where(sub, high - 6, e)
    return (e - 127).to(torch.float32) + LOGFMT_LOG2[f]


def logfmt_exp2(t):
    """exp2x of the spec: Horner of the Taylor coefficients on t - floor(t), times 2^floor(t)."""
    n = torch.floor(t)
    f = t - n
    q = LOGFMT_EXP2[9].expand_as(f)
    for k in range(8, -1, -1):
        q = q * f + LOGFMT_EXP2[k]
    ni = n.to(torch.int64)
    normal = ni >= -126
    scale = torch.pow(2.0, torch.where(normal, ni, ni + 126).to(torch.float64))
    r = q * scale.to(torch.float32)
    r = torch.where(normal, r, r * torch.tensor(2.0 ** -126, dtype=torch.float32))
    return torch.where(ni < -252, torch.zeros_like(r), r)


def logfmt_decode(x):
    """The float32 values LogFMT-10 delivers for bf16 `x` [..., H] (H % 128 == 0): each group of
    128 channels cast (10-bit log codes) or raw (unchanged)."""
    shape = x.shape
    x = x.reshape(-1, 128)
    h = x.view(torch.int16).to(torch.int64) & 0xFFFF
    mag, sign = h & 0x7FFF, h >> 15
    amax = mag.amax(dim=1, keepdim=True)
    amin = mag.amin(dim=1, keepdim=True)
    cast = (amax < 0x3F80) & (amin < amax)
    la = logfmt_log2(torch.where(cast, amax, torch.ones_like(amax)))
    clip = la - 32.0
    lb = torch.where(amin > 0, torch.maximum(logfmt_log2(amin.clamp(min=1)), clip), clip)
    step = (la - lb) / 510.0
    inv = torch.div(torch.ones_like(step), step)
    y = (logfmt_log2(mag.clamp(min=1)) - lb) * inv + 1.5
    code = torch.where(y >= 511, torch.full_like(y, 511), torch.floor(y))
    code = torch.where((y >= 1) & (mag > 0), code, torch.zeros_like(code)).to(torch.int64)
    v = logfmt_exp2(lb + (code - 1).to(torch.float32) * step)
    v = torch.where(code == 0, torch.zeros_like(v), v)
    v = torch.where(sign == 1, -v, v)
    return torch.where(cast, v, x.to(torch.float32)).reshape(shape)


# ---- ht (docs/semantics.md §1) ------------------------------------------------------------------

def goes_to(topk_idx, rank, num_experts, num_ranks):
    """bool [T]: token t selects some expert on `rank`."""
    L = num_experts // num_ranks
    return ((topk_idx >= 0) & (topk_idx // L == rank)).any(dim=1)


def ht_layout(topk_idx, num_experts, num_ranks):
    T = topk_idx.shape[0]
    in_rank = torch.zeros(T, num_ranks, dtype=torch.bool)
    for d in range(num_ranks):
        in_rank[:, d] = goes_to(topk_idx, d, num_experts, num_ranks)
    per_rank = in_rank.sum(dim=0).to(torch.int32)
    valid = topk_idx[topk_idx >= 0]
    per_expert = torch.bincount(valid, minlength=num_experts).to(torch.int32)
    return per_rank, per_expert, in_rank


def ht_dispatch(inputs, rank, num_experts, num_ranks, expert_alignment=1):
    """inputs[s] = dict(x, topk_idx, topk_weights[, scales]) of every rank s. What `rank`
    receives: rows by source rank, then source index."""
    L = num_experts // num_ranks
    xs, scales, idxs, ws, srcs, counts = [], [], [], [], [], []
    for s in range(num_ranks):
        inp = inputs[s]
        sel = goes_to(inp["topk_idx"], rank, num_experts, num_ranks).nonzero().flatten()
        counts.append(len(sel))
        xs.append(inp["x"][sel])
        if inp.get("scales") is not None:
            scales.append(inp["scales"][sel])
        idx = inp["topk_idx"][sel]
        local = (idx >= 0) & (idx // L == rank)
        idxs.append(torch.where(local, idx - rank * L, torch.full_like(idx, -1)))
        if inp.get("topk_weights") is not None:
            w = inp["topk_weights"][sel]
            ws.append(torch.where(local, w, torch.zeros_like(w)))
        srcs.append(sel.to(torch.int32))
    recv_idx = torch.cat(idxs)
    per_expert = [int((recv_idx == l).sum()) for l in range(L)]
    aligned = [(c + expert_alignment - 1) // expert_alignment * expert_alignment
               for c in per_expert]
    return dict(recv_x=torch.cat(xs), recv_scales=torch.cat(scales) if scales else None,
                recv_topk_idx=recv_idx, recv_topk_weights=torch.cat(ws) if ws else None,
                recv_src_idx=torch.cat(srcs), num_recv_tokens_per_expert=aligned,
                counts_by_source=counts)


def rank_prefix_matrix(inputs, num_experts, num_ranks):
    """[R, R] int32: [s][d] = tokens received by d from ranks 0..s."""
    m = torch.zeros(num_ranks, num_ranks, dtype=torch.int64)
    for s in range(num_ranks):
        for d in range(num_ranks):
            m[s, d] = int(goes_to(inputs[s]["topk_idx"], d, num_experts, num_ranks).sum())
    return m.cumsum(dim=0).to(torch.int32)


def nodes_in_order(rank, num_ranks, ranks_per_node):
    """The nodes of a combine's sum, as lists of their ranks: this rank's node first, then the
    others ascending (docs/semantics.md §1.6 / §2.3; ranks_per_node 0: one node)."""
    G = ranks_per_node or num_ranks
    own = rank // G
    return [list(range(m * G, (m + 1) * G))
            for m in [own] + [m for m in range(num_ranks // G) if m != own]]


def ht_combine(inputs, ys, rank, num_experts, num_ranks, bias0=None, bias1=None,
               ranks_per_node=0):
    """out[t] on `rank` = bias0 + bias1 + the y_d[pos_d(t)] of the ranks d that t went to,
    float32, one rounding to bf16, in the order of docs/semantics.md §1.6: this rank's node's
    ranks ascending into the sum that holds the biases, then per other node (ascending) that t
    reached a partial from 0.0f over its ranks ascending (one node: the ranks ascending).
    ys[d] = y [N_d, H] of rank d (in d's recv_x order)."""
    idx = inputs[rank]["topk_idx"]
    T = idx.shape[0]
    H = ys[0].shape[1] if ys else 0
    acc = torch.zeros(T, H, dtype=torch.float32)
    if bias0 is not None:
        acc = f32_add(acc, bias0.to(torch.float32))
    if bias1 is not None:
        acc = f32_add(acc, bias1.to(torch.float32))
    for i, node in enumerate(nodes_in_order(rank, num_ranks, ranks_per_node)):
        part = acc if i == 0 else torch.zeros(T, H, dtype=torch.float32)
        reached = torch.zeros(T, dtype=torch.bool)
        for d in node:
            # Rank d's rows: sources 0..rank-1 first, then this rank's tokens in index order.
            before = sum(int(goes_to(inputs[s]["topk_idx"], d, num_experts, num_ranks).sum())
                         for s in range(rank))
            went = goes_to(idx, d, num_experts, num_ranks)
            sel = went.nonzero().flatten()
            rows = ys[d][before:before + len(sel)].to(torch.float32)
            part[sel] = f32_add(part[sel], rows)
            reached |= went
        if i > 0:
            acc[reached] = f32_add(acc[reached], part[reached])
    return acc.to(torch.bfloat16)


# ---- ll (docs/semantics.md §2) ------------------------------------------------------------------

def ll_dispatch(inputs, rank, num_experts, num_ranks, max_tokens, use_fp8, round_scale=False,
                nvfp4_scale=None):
    """Expert-major receive of `rank`: per local expert l, rows by source rank then source index;
    a token that lists expert e several times gets one row for e. With `nvfp4_scale` (g): the
    rows' NVFP4 values [n, H/2] and e4m3 scales [n, H/16] (quantize_nvfp4)."""
    L = num_experts // num_ranks
    rows = [[] for _ in range(L)]  # (src_rank, src_idx)
    for s in range(num_ranks):
        idx = inputs[s]["topk_idx"]
        for l in range(L):
            e = rank * L + l
            for t in (idx == e).any(dim=1).nonzero().flatten().tolist():
                rows[l].append((s, t))
    quant = {}
    for s in range(num_ranks):
        if nvfp4_scale is not None:
            quant[s] = quantize_nvfp4(inputs[s]["x"], nvfp4_scale)
        elif use_fp8:
            quant[s] = quantize_fp8(inputs[s]["x"], round_scale)
    out = []
    for l in range(L):
        xs, sc, src = [], [], []
        for s, t in rows[l]:
            if quant:
                xs.append(quant[s][0][t])
                sc.append(quant[s][1][t])
            else:
                xs.append(inputs[s]["x"][t])
            src.append(t)
        layout = []
        begin = 0
        for s in range(num_ranks):
            n = sum(1 for ss, _ in rows[l] if ss == s)
            layout.append((begin << 32) | n)
            begin += n
        out.append(dict(x=torch.stack(xs) if xs else None, scales=torch.stack(sc) if sc else None,
                        src_info=torch.tensor(src, dtype=torch.int32), count=len(rows[l]),
                        layout_range=torch.tensor(layout, dtype=torch.int64)))
    return out


def ll_combine(inputs, ys, rank, num_experts, num_ranks, use_logfmt=False, ranks_per_node=0):
    """out[t] = fma chain over k (topk_idx != -1) of w[t][k] * y(t, k), one rounding to bf16.
    ys[d] = y [L, R*T_max, H] of rank d; y(t, k) = the row of (rank, t) in expert e's block on
    rank e / L (use_logfmt: as logfmt_decode delivers it). Across nodes (docs/semantics.md §2.3)
    one chain per node over the k whose expert lives there, this rank's node's first, then the
    other nodes' that t reached, ascending, each from 0.0f, added in float32."""
    L = num_experts // num_ranks
    idx = inputs[rank]["topk_idx"]
    w = inputs[rank]["topk_weights"]
    T, K = idx.shape
    H = ys[0].shape[2]
    # Row of (rank, t) in expert e's list on its owner: tokens of lower ranks first.
    row_of = {}
    for e in set(idx[idx >= 0].tolist()):
        d, l = e // L, e % L
        before = sum(int((inputs[s]["topk_idx"] == e).any(dim=1).sum()) for s in range(rank))
        mine = (idx == e).any(dim=1).nonzero().flatten().tolist()
        for j, t in enumerate(mine):
            row_of[(e, t)] = (d, l, before + j)
    nodes = nodes_in_order(rank, num_ranks, ranks_per_node)
    acc = torch.zeros(T, H, dtype=torch.float32)
    for t in range(T):
        for i, node in enumerate(nodes):
            ks = [k for k in range(K) if int(idx[t, k]) >= 0 and int(idx[t, k]) // L in node]
            if i > 0 and not ks:
                continue
            part = acc[t] if i == 0 else torch.zeros(H, dtype=torch.float32)
            for k in ks:
                d, l, row = row_of[(int(idx[t, k]), t)]
                if use_logfmt:
                    part = f32_fma_exact(w[t, k].expand(H), logfmt_decode(ys[d][l, row]), part)
                else:
                    part = f32_fma(w[t, k].expand(H), ys[d][l, row].to(torch.float32), part)
            acc[t] = part if i == 0 else f32_add(acc[t], part)
    return acc.to(torch.bfloat16)


# ---- a2a (docs/semantics.md §3) -----------------------------------------------------------------

def a2a_targets(topk_idx, num_experts, num_ranks):
    """bool [T, R]: token t goes to rank d (once, however many experts there)."""
    L = num_experts // num_ranks
    T = topk_idx.shape[0]
    m = torch.zeros(T, num_ranks, dtype=torch.bool)
    for d in range(num_ranks):
        m[:, d] = ((topk_idx >= 0) & (topk_idx // L == d)).any(dim=1)
    return m


def a2a_dispatch(inputs, rank, num_experts, num_ranks):
    """Per payload, per source s: the rows of s's tokens that go to `rank`, in index order."""
    recv = []  # recv[s] = list per payload of [n_s, ...]
    counts = []
    for s in range(num_ranks):
        sel = a2a_targets(inputs[s]["topk_idx"], num_experts, num_ranks)[:, rank]
        sel = sel.nonzero().flatten()
        counts.append(len(sel))
        recv.append([p[sel] for p in inputs[s]["payloads"]])
    return recv, counts


def a2a_combine(inputs, ys, rank, num_experts, num_ranks):
    """out[t] = sum over distinct d that t went to, ascending, of y_d[rank][slot_d(t)], float32,
    one rounding to y's dtype (bf16, float16 or float32). ys[d] = [R, M, H] of rank d."""
    idx = inputs[rank]["topk_idx"]
    T = idx.shape[0]
    H = ys[0].shape[2]
    targets = a2a_targets(idx, num_experts, num_ranks)
    acc = torch.zeros(T, H, dtype=torch.float32)
    for d in range(num_ranks):
        sel = targets[:, d].nonzero().flatten()
        acc[sel] = f32_add(acc[sel], ys[d][rank, :len(sel)].to(torch.float32))
    return acc.to(ys[0].dtype)
