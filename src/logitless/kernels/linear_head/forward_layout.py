"""The forward's vocabulary splits per token block: host arithmetic on shapes, cached (launch reads it as
plans._fwd_layout)."""

from __future__ import annotations

import functools

from .._common import cdiv


@functools.lru_cache(maxsize=1024)
def _fwd_layout(n_blocks: int, n_vtiles: int, sms: int, group: int, waves: int) -> tuple[int, int, int, int]:
    """Vocabulary splits of the forward: (n_big, tiles_big, n_small, tiles_small). Every token block's tiles are
    cut the same way: n_big splits of tiles_big, then the remaining tiles in n_small splits of tiles_small (the
    last one shorter). The n_blocks * n_big programs of the first phase run before those of the second.

    One program per multiprocessor runs at a time, so with equal splits the last wave leaves most of the GPU idle
    while a few programs finish (docs/design/forward.md, "The grid in two phases"). Here the first
    phase is sized to end, on the busiest multiprocessors, at the even share of all tiles, and the second phase's
    short programs fill the others up to it; what is left is about half a short program. A split count keeps about
    sms / 2 programs on one group of token blocks at a time (their x blocks and W tiles shared in L2), and at most
    max(sms / (2 group), 2 waves sms / n_blocks) + 32 splits keep the partials small (float32 per row and split). The
    plan is estimated in tiles (each program also costs ~0.1 tile: its first loads and its partial stores), and
    taken only where it beats the equal splits of `waves` programs per multiprocessor."""
    total = n_blocks * n_vtiles
    share = total / sms
    g = min(group, n_blocks)
    n_lo = max(1, min(n_vtiles, cdiv(sms, 2 * g)))
    want = max(1, min(n_vtiles, round(waves * sms / n_blocks)))

    def estimate(n_big, a, n_small, b):
        programs = n_blocks * (n_big + n_small)
        if n_small == 0:  # equal splits (the last may be shorter): the waves of the first phase alone
            end = cdiv(programs, sms) * a
        else:
            rounds = cdiv(n_blocks * n_big, sms)
            end = max(rounds * a, share) + b / 2
        return end + 0.1 * programs / sms + 1e-3 * (n_big + n_small)

    # Equal splits of a tiles (the last one shorter, as a second phase of one split).
    a = cdiv(n_vtiles, want)
    best = (estimate(cdiv(n_vtiles, a), a, 0, 0), n_vtiles // a, a, int(n_vtiles % a > 0), n_vtiles % a)
    # First-phase split counts: the few above n_lo, and those that make the first phase about k full waves.
    hi = max(n_lo, 2 * want)
    counts = set(range(n_lo, min(hi, n_lo + 16) + 1))
    for k in range(1, 65):
        counts.update((k * sms // n_blocks, cdiv(k * sms, n_blocks)))
    max_small = min(2 * n_lo, 32)
    for n_big in sorted(c for c in counts if n_lo <= c <= hi):
        rounds = cdiv(n_blocks * n_big, sms)
        a = min(n_vtiles // n_big, int(total // (sms * rounds)))
        if a < 1:
            break
        rest = n_vtiles - n_big * a
        if rest == 0:
            cand = [(n_big, a, 0, 0)]
        else:
            b_min = cdiv(rest, max_small)
            cand = [(n_big, a, cdiv(rest, b), b) for b in range(b_min, min(rest, b_min + 8) + 1)]
        for c in cand:
            e = estimate(*c)
            if e < best[0]:
                best = (e, *c)
    return best[1:]
