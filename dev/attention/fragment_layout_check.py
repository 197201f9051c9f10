#!/usr/bin/env python3
"""Host-side check of the shared-memory layout and fragment addressing in attention.cu.

Models, lane by lane, the swizzle used by cp.async / epilogue stores, the ldmatrix address
helpers (ldsm_base / ldsm_block) and the PTX-specified semantics of ldmatrix (.trans or not)
and of the m16n8k16 A/B fragments, then asserts that every ldmatrix call pattern used by the
kernels hands each lane exactly the matrix elements the MMA expects, and that each 8-lane
phase of an ldmatrix hits 8 distinct 16-byte bank groups (no bank conflicts).
Runs without a GPU: python3 dev/attention/fragment_layout_check.py
"""

import itertools
import sys


# ---- the C++ formulas, transcribed ----
def swizzle(kcols, row, col):
    return row * kcols * 2 + (((col >> 3) ^ (row & 7)) << 4) + ((col & 7) << 1)


def ldsm_base(kcols, order, tile, lane):
    if order == "RowMajor16":
        r, b = lane & 15, lane >> 4
    else:  # RowPairs8
        r, b = (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1
    return tile + r * kcols * 2 + ((b ^ (r & 1)) << 4) + (((r >> 1) & 3) << 5)


def ldsm_block(kcols, base, row0, cp):
    return (base ^ ((cp & 3) << 5)) + row0 * kcols * 2 + ((cp >> 2) << 7)


# ---- shared memory model: address of a 16-byte chunk -> (row, first col) ----
def chunk_map(kcols, rows, tile):
    m = {}
    for r in range(rows):
        for c in range(0, kcols, 8):
            a = tile + swizzle(kcols, r, c)
            assert a % 16 == 0
            assert a not in m
            m[a] = (r, c)
            # elements inside a chunk are contiguous and in order
            for e in range(8):
                assert tile + swizzle(kcols, r, c + e) == a + 2 * e
    return m


def ldmatrix(cmap, addrs, trans):
    """addrs[lane] = row address given by lane. Returns regs[lane][i] = (elem_lo, elem_hi),
    each elem a (row, col) of the tile."""
    mats = []
    for i in range(4):
        rows = []
        for rr in range(8):
            a = addrs[8 * i + rr]
            assert a in cmap, f"address {a} not a chunk start"
            r, c = cmap[a]
            rows.append([(r, c + e) for e in range(8)])
        mats.append(rows)
    regs = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        lane_regs = []
        for i in range(4):
            m = mats[i]
            if not trans:
                lane_regs.append((m[g][2 * t], m[g][2 * t + 1]))
            else:
                lane_regs.append((m[2 * t][g], m[2 * t + 1][g]))
        regs.append(lane_regs)
    return regs


def bank_conflict_free(addrs):
    for i in range(4):
        groups = {(addrs[8 * i + rr] // 16) % 8 for rr in range(8)}
        if len(groups) != 8:
            return False
    return True


failures = 0
checks = 0


def expect(cond, what):
    global failures, checks
    checks += 1
    if not cond:
        failures += 1
        print("FAIL:", what)


# Expected fragments, as element (row, col) pairs of the stored tile M.
def expect_a_rowmajor(row0, col0, lane):  # A[m][k] stored [m][k]
    g, t = lane // 4, lane % 4
    A = lambda m, k: (row0 + m, col0 + k)
    return [(A(g, 2 * t), A(g, 2 * t + 1)), (A(g + 8, 2 * t), A(g + 8, 2 * t + 1)),
            (A(g, 2 * t + 8), A(g, 2 * t + 9)), (A(g + 8, 2 * t + 8), A(g + 8, 2 * t + 9))]


def expect_b_nk(n0, k0, lane):  # B[k][n] stored [n][k]; regs = b0,b1 of n-tile n0, then n0+8
    g, t = lane // 4, lane % 4
    M = lambda n, k: (n0 + n, k0 + k)
    return [(M(g, 2 * t), M(g, 2 * t + 1)), (M(g, 2 * t + 8), M(g, 2 * t + 9)),
            (M(g + 8, 2 * t), M(g + 8, 2 * t + 1)), (M(g + 8, 2 * t + 8), M(g + 8, 2 * t + 9))]


def expect_b_kn(k0, n0, lane):  # B[k][n] stored [k][n]
    g, t = lane // 4, lane % 4
    M = lambda k, n: (k0 + k, n0 + n)
    return [(M(2 * t, g), M(2 * t + 1, g)), (M(2 * t + 8, g), M(2 * t + 9, g)),
            (M(2 * t, g + 8), M(2 * t + 1, g + 8)), (M(2 * t + 8, g + 8), M(2 * t + 9, g + 8))]


def expect_a_km(k0, m0, lane):  # A[m][k] stored [k][m]
    g, t = lane // 4, lane % 4
    M = lambda k, m: (k0 + k, m0 + m)
    return [(M(2 * t, g), M(2 * t + 1, g)), (M(2 * t, g + 8), M(2 * t + 1, g + 8)),
            (M(2 * t + 8, g), M(2 * t + 9, g)), (M(2 * t + 8, g + 8), M(2 * t + 9, g + 8))]


def run_pattern(name, kcols, rows, tile, order, trans, blocks, expected_fn, base_extra=0):
    """blocks: iterable of (row0, cp, extra_offset) as the kernel computes them."""
    cmap = chunk_map(kcols, rows, tile)
    for row0, cp, extra in blocks:
        addrs = [ldsm_block(kcols, ldsm_base(kcols, order, tile + base_extra, lane), row0, cp) + extra
                 for lane in range(32)]
        regs = ldmatrix(cmap, addrs, trans)
        ok = all(regs[lane] == expected_fn(row0, cp, extra, lane) for lane in range(32))
        expect(ok, f"{name} kcols={kcols} row0={row0} cp={cp} extra={extra}")
        expect(bank_conflict_free(addrs), f"{name} bank conflicts kcols={kcols} row0={row0} cp={cp}")


for kd in (64, 128):
    for tile in (0, 1024 * 7, 128 * 3):  # any 128-byte aligned tile start
        # Forward / dQ kernel: A = Q (or dO) rows of a warp, base offset warp_row0 rows.
        for warp_row0 in (0, 16, 32, 96):
            run_pattern("A Q[m][k]", kd, 128, tile, "RowMajor16", False,
                        [(mi * 16, kk, 0) for mi in range(2) for kk in range(kd // 16)
                         if warp_row0 + mi * 16 < 128],
                        lambda row0, cp, extra, lane, w=warp_row0: expect_a_rowmajor(w + row0, 16 * cp, lane),
                        base_extra=warp_row0 * kd * 2)
        # S = Q K^T: B = K stored [key][d].
        run_pattern("B K[n][k]", kd, 64, tile, "RowPairs8", False,
                    [(nj * 16, kk, 0) for nj in range(4) for kk in range(kd // 16)],
                    lambda row0, cp, extra, lane: expect_b_nk(row0, 16 * cp, lane))
        # O += P V: B = V stored [key=k][d=n], .trans.
        run_pattern("B V[k][n] trans", kd, 64, tile, "RowMajor16", True,
                    [(kk * 16, dj, 0) for kk in range(4) for dj in range(kd // 16)],
                    lambda row0, cp, extra, lane: expect_b_kn(row0, 16 * cp, lane))
        # dkdv: dQ = dS K with B = K [key][d] .trans at column blocks wd*kSlice/16 + sj.
        kslice = kd // 2
        run_pattern("B K[k][n] trans (dQ slices)", kd, 128, tile, "RowMajor16", True,
                    [(kk * 16, wd * (kslice // 16) + sj, 0) for kk in range(8) for wd in range(2)
                     for sj in range(kslice // 16)],
                    lambda row0, cp, extra, lane: expect_b_kn(row0, 16 * cp, lane))

# dkdv atomic dQ: A = dS from dS^T stored [key][query], 64 query columns, .trans; the kernel
# computes ldsm_block(base, 0, wm) and adds kk*16 rows.
for tile in (0, 128 * 5):
    kcols = 64
    cmap = chunk_map(kcols, 128, tile)
    for wm in range(4):
        for kk in range(8):
            addrs = [ldsm_block(kcols, ldsm_base(kcols, "RowPairs8", tile, lane), 0, wm) + kk * 16 * kcols * 2
                     for lane in range(32)]
            regs = ldmatrix(cmap, addrs, True)
            ok = all(regs[lane] == expect_a_km(kk * 16, wm * 16, lane) for lane in range(32))
            expect(ok, f"A dS^T[k][m] trans wm={wm} kk={kk}")
            expect(bank_conflict_free(addrs), f"A dS^T bank conflicts wm={wm} kk={kk}")

# dkdv: A = K / V rows of the warp (row-major), base offset warp_key0 rows; B = Q/dO [n][k];
# B = Q/dO [k][n] .trans (same helpers as above, other tile heights).
for kd in (64, 128):
    for warp_key0 in range(0, 128, 16):
        run_pattern("A K rows (dkdv)", kd, 128, 0, "RowMajor16", False,
                    [(0, kk, 0) for kk in range(kd // 16)],
                    lambda row0, cp, extra, lane, w=warp_key0: expect_a_rowmajor(w + row0, 16 * cp, lane),
                    base_extra=warp_key0 * kd * 2)

# Fragment stores (epilogue, dS^T): lanes (g, t) write 4 bytes at (row0 + g (+8), 8 di + 2t):
# each 8-lane... a warp's 32 stores of one instruction must hit 32 distinct banks.
for kcols in (64, 128):
    for di in range(kcols // 8):
        for half in (0, 8):
            banks = set()
            for lane in range(32):
                g, t = lane // 4, lane % 4
                a = swizzle(kcols, g + half, di * 8 + 2 * t)
                banks.add((a // 4) % 32)
            expect(len(banks) == 32, f"fragment store conflicts kcols={kcols} di={di}")

# cp.async tile writes: 32 consecutive chunks of one warp instruction cover each bank 4 times
# at most per 128 bytes (a 512-byte warp write needs 4 wavefronts anyway).
for kcols in (64, 128):
    per_row = kcols // 8
    for start in range(0, 64 * per_row, 32):
        counts = {}
        for lane in range(32):
            c = start + lane
            a = swizzle(kcols, c // per_row, (c % per_row) * 8)
            grp = (a // 16) % 8
            counts[grp] = counts.get(grp, 0) + 1
        expect(max(counts.values()) == 4, f"cp.async write spread kcols={kcols} start={start}")

print(f"{checks - failures} passed, {failures} failed")
sys.exit(1 if failures else 0)
