"""The gradient products of a vocabulary chunk over a skip plan's hot (token block, tile) pairs only, for a backward
that writes the dz of those pairs alone (the two-head losses'): one _dgrad_kernel launch, the same kernel and lists
as the linear head's skipping backward, without its split reductions or a vocabulary order."""

from .._common import cdiv
from .._launch import launch
from .._tuning import current_tuning
from . import backward_kernels as bk
from .configs import Config, dot_flags
from .plans import SkipPlan


def hot_products(dz, x, wc, dw_rows, dx_acc, accumulate: bool, sp: SkipPlan, cfg: Config, v0: int, v1: int) -> None:
    """dw_rows = dz^T x and dx_acc (float32) = or += dz wc over the hot pairs of sp in classes [v0, v1) (a chunk of
    whole tiles of the plan's map, cfg.block_n x cfg.block_v, which the products' tiles divide: two_heads'
    skip_supported); dz (N, v1 - v0) is read at hot pairs only, and either output may be None."""
    N, D = x.shape
    rows = v1 - v0
    do_dw, do_dx = dw_rows is not None, dx_acc is not None
    if not (do_dw or do_dx):
        return
    n_out = cdiv(rows, cfg.block_m) * cdiv(D, cfg.block_d)
    n_dw = n_out if do_dw else 0
    n_dx = cdiv(N, cfg.block_m) * cdiv(D, cfg.dx_d) if do_dx else 0
    n_blocks, n_vtiles = sp.hot.shape
    launch(bk._dgrad_kernel, (n_dw + n_dx,),
        dz, x, wc, dw_rows, dx_acc, None, sp.list_n, sp.pre_n, sp.list_v, sp.pre_v, None, None,
        None, None, None, None,
        N, D, rows, n_dw, N, n_out, n_blocks, n_vtiles, v0 // cfg.block_v, cdiv(v1, cfg.block_v),
        dz.stride(0), x.stride(0), x.stride(1), wc.stride(0), wc.stride(1),
        dw_rows.stride(0) if do_dw else 0, dw_rows.stride(1) if do_dw else 0, 0,
        dx_acc.stride(0) if do_dx else 0, dx_acc.stride(1) if do_dx else 0,
        DO_DW=do_dw, DO_DX=do_dx, DX_ACCUMULATE=accumulate, DW_EVEN_K=N % cfg.block_kg == 0,
        DX_EVEN_K=rows % cfg.block_kg == 0, HAS_PERM=False, DW_SCATTER=False, SKIP=True,
        MAP_N=cfg.block_n, MAP_V=cfg.block_v, BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d, DX_BLOCK_D=cfg.dx_d,
        BLOCK_K=cfg.block_kg, GROUP=cfg.group, **dot_flags(x), USE_TMA=False,
        DX_FIRST=bool(current_tuning().skip_dx_first and do_dw and do_dx), DX_SPLIT=1,
        num_warps=cfg.grad_warps, num_stages=cfg.grad_stages,
    )
