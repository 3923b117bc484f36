"""IQ3_S lattice tables: the 512-point grid, the point -> grid-index map and the off-grid neighbour lists.

The grid is data of the GGML format (identical to `gguf.quants.IQ3_S.grid`, checked by the tests). Each entry
is stored as its 12-bit point code `sum_j l_j << 3j`, where `2 l_j + 1` (1..15) is coordinate j. The entries
are in ascending code order, so a point's grid index is its rank among the codes.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

GRID_SIZE = 512
N_POINTS = 4096                 # 8 levels ** 4 coordinates
NEIGHBOUR_DISTANCES = 3         # an off-grid point lists the grid points at its 3 smallest distinct distances

GRID_CODES = (
       0,    1,    2,    5,    7,    8,    9,   10,   12,   14,   16,   17,   21,   27,   32,   34,
      37,   39,   41,   43,   48,   50,   57,   60,   63,   64,   65,   66,   68,   72,   73,   77,
      80,   83,   87,   89,   93,  100,  113,  117,  122,  128,  129,  133,  135,  136,  139,  142,
     145,  149,  152,  156,  162,  165,  167,  169,  171,  184,  187,  195,  201,  205,  208,  210,
     217,  219,  222,  228,  232,  234,  247,  249,  253,  256,  267,  271,  273,  276,  282,  288,
     291,  297,  312,  322,  324,  336,  338,  342,  347,  353,  357,  359,  374,  379,  390,  393,
     395,  409,  426,  441,  448,  450,  452,  464,  466,  470,  475,  488,  492,  512,  513,  514,
     516,  520,  521,  523,  525,  527,  528,  530,  537,  540,  542,  556,  558,  561,  570,  576,
     577,  579,  582,  584,  588,  593,  600,  603,  609,  616,  618,  632,  638,  640,  650,  653,
     655,  656,  660,  666,  672,  675,  685,  688,  698,  705,  708,  711,  712,  715,  721,  727,
     728,  732,  737,  754,  760,  771,  773,  778,  780,  793,  795,  802,  806,  808,  812,  833,
     840,  843,  849,  856,  858,  873,  912,  916,  919,  932,  934,  961,  963,  968,  970,  977,
     989,  993, 1010, 1016, 1024, 1025, 1027, 1029, 1031, 1032, 1034, 1036, 1038, 1041, 1043, 1047,
    1048, 1050, 1057, 1059, 1061, 1064, 1066, 1079, 1080, 1083, 1085, 1088, 1090, 1096, 1099, 1103,
    1106, 1109, 1113, 1116, 1122, 1129, 1153, 1156, 1159, 1169, 1171, 1176, 1183, 1185, 1195, 1199,
    1209, 1212, 1216, 1218, 1221, 1225, 1234, 1236, 1241, 1243, 1250, 1256, 1270, 1281, 1287, 1296,
    1299, 1306, 1309, 1313, 1338, 1341, 1348, 1353, 1362, 1375, 1376, 1387, 1400, 1408, 1410, 1415,
    1425, 1453, 1457, 1477, 1481, 1494, 1496, 1507, 1512, 1538, 1545, 1547, 1549, 1551, 1554, 1561,
    1563, 1565, 1570, 1572, 1575, 1577, 1587, 1593, 1601, 1603, 1605, 1612, 1617, 1619, 1632, 1648,
    1658, 1662, 1664, 1674, 1680, 1690, 1692, 1704, 1729, 1736, 1740, 1745, 1747, 1751, 1752, 1761,
    1763, 1767, 1773, 1787, 1795, 1801, 1806, 1810, 1817, 1834, 1840, 1844, 1857, 1864, 1866, 1877,
    1882, 1892, 1902, 1915, 1934, 1953, 1985, 1987, 2000, 2002, 2013, 2048, 2052, 2058, 2064, 2068,
    2071, 2074, 2081, 2088, 2104, 2114, 2119, 2121, 2123, 2130, 2136, 2141, 2147, 2153, 2157, 2177,
    2179, 2184, 2189, 2193, 2203, 2208, 2223, 2226, 2232, 2244, 2249, 2251, 2256, 2258, 2265, 2269,
    2304, 2306, 2324, 2335, 2336, 2361, 2373, 2375, 2385, 2418, 2443, 2460, 2480, 2504, 2509, 2520,
    2531, 2537, 2562, 2568, 2572, 2578, 2592, 2596, 2599, 2602, 2614, 2620, 2625, 2627, 2629, 2634,
    2641, 2650, 2682, 2688, 2697, 2707, 2712, 2718, 2731, 2754, 2759, 2760, 2775, 2788, 2793, 2805,
    2811, 2817, 2820, 2832, 2842, 2854, 2890, 2902, 2921, 2923, 2978, 3010, 3012, 3026, 3081, 3083,
    3085, 3097, 3099, 3120, 3136, 3152, 3159, 3188, 3210, 3228, 3234, 3245, 3250, 3256, 3264, 3276,
    3281, 3296, 3349, 3363, 3378, 3392, 3395, 3420, 3440, 3461, 3488, 3529, 3531, 3584, 3588, 3591,
    3600, 3602, 3614, 3616, 3628, 3634, 3650, 3657, 3668, 3683, 3685, 3713, 3716, 3720, 3726, 3729,
    3736, 3753, 3778, 3802, 3805, 3819, 3841, 3845, 3851, 3856, 3880, 3922, 3938, 3970, 3993, 4032,
)


def _levels(codes: np.ndarray) -> np.ndarray:
    """[n] 12-bit point codes -> [n, 4] levels 0..7."""
    return (codes[:, None] >> np.array([0, 3, 6, 9])) & 7


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)       # cached and shared: a caller must not modify it
    return arr


@lru_cache(maxsize=1)
def grid_levels() -> np.ndarray:
    """[512, 4] int16 levels l (coordinate value 2l+1)."""
    return _frozen(_levels(np.asarray(GRID_CODES, dtype=np.int64)).astype(np.int16))


@lru_cache(maxsize=1)
def grid_values() -> np.ndarray:
    """[512, 4] float32 coordinate values 1, 3, ..., 15 (what the decoder multiplies by)."""
    return _frozen((2 * grid_levels() + 1).astype(np.float32))


@lru_cache(maxsize=1)
def grid_norms() -> np.ndarray:
    """[512] float32 squared norms sum_j g_j^2 (exact integers)."""
    g = grid_values()
    return _frozen((g * g).sum(axis=1))


@lru_cache(maxsize=1)
def grid_bytes() -> np.ndarray:
    """[512] uint32, byte j = coordinate j (the ggml `iq3s_grid` word)."""
    v = grid_values().astype(np.uint32)
    return _frozen(v[:, 0] | v[:, 1] << 8 | v[:, 2] << 16 | v[:, 3] << 24)


@lru_cache(maxsize=1)
def neighbour_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kmap [4096] int32, starts [4097] int32, flat [n] int16).

    kmap[p] is the grid index of point p, or -1 if p is off the grid. For an off-grid point the candidate
    list is flat[starts[p]:starts[p + 1]]: every grid point whose squared distance to p (in 2l+1
    coordinates) is among the 3 smallest distinct distances, ordered by (distance, grid index).
    """
    codes = np.asarray(GRID_CODES, dtype=np.int64)
    kmap = np.full(N_POINTS, -1, dtype=np.int32)
    kmap[codes] = np.arange(GRID_SIZE, dtype=np.int32)
    pts = 2 * _levels(np.arange(N_POINTS)) + 1                                         # [4096, 4]
    dist = ((pts[:, None, :] - grid_values()[None].astype(np.int64)) ** 2).sum(-1)     # [4096, 512]
    order = np.argsort(dist * GRID_SIZE + np.arange(GRID_SIZE), axis=1)               # by (distance, index)
    sorted_d = np.take_along_axis(dist, order, axis=1)
    rank = np.cumsum(np.diff(sorted_d, axis=1, prepend=-1) > 0, axis=1)               # 1 = smallest distance
    keep = (rank <= NEIGHBOUR_DISTANCES) & (kmap < 0)[:, None]
    starts = np.zeros(N_POINTS + 1, dtype=np.int32)
    np.cumsum(keep.sum(axis=1), out=starts[1:])
    flat = order[keep].astype(np.int16)                   # row-major: point by point, each list in order
    return _frozen(kmap), _frozen(starts), _frozen(flat)
