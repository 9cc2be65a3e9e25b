"""The backward's two gradient products of a chunk through torch (cuBLAS on CUDA) instead of _dgrad_kernel:
dW rows = dz^T x (float32 accumulation, one rounding) and the float32 dx accumulator = or += dz W[chunk], under
float32-only cuBLAS reductions."""

import threading

import torch

from .._tuning import current_tuning

# torch has matmuls with a float32 output for bfloat16 / float16 operands (>= 2.8).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out") and hasattr(torch.ops.aten.mm, "dtype_out")


def _torch_products(x: torch.Tensor, w: torch.Tensor, skip: bool, has_perm: bool) -> bool:
    """Whether the products run through torch (Tuning.torch_products; by default for bfloat16 / float16 on CUDA)."""
    # Rows with unit stride only: cuBLAS would need a copy of an operand strided otherwise. Half-precision operands
    # on CUDA need matmuls with a float32 output.
    if skip or has_perm or x.stride(1) != 1 or w.stride(1) != 1:
        return False
    if x.is_cuda and x.dtype != torch.float32 and not _MM_OUT_DTYPE:
        return False
    forced = current_tuning().torch_products
    if forced is not None:
        return forced
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _MM_OUT_DTYPE


class _Fp32Reductions:
    """While active, cuBLAS reduces bfloat16 / float16 products in float32 only: by default PyTorch lets it reduce
    split-K partials in the output's dtype (and a user may turn on float16 accumulation), which would be bf16 / fp16
    accumulation across tiles. Reentrant and thread-safe (autograd runs one backward thread per GPU): the first
    entry saves the user's settings, the last exit restores them, and in between every cuBLAS call of the process
    reduces in float32 (never less precise than the user asked)."""

    _lock = threading.Lock()
    _active = 0
    _saved: dict = {}

    def __enter__(self):
        with self._lock:
            if _Fp32Reductions._active == 0:
                saved = {}
                for k in ("bf16", "fp16"):
                    get = getattr(torch._C, f"_get_cublas_allow_{k}_reduced_precision_reduction", None)
                    if get is not None:
                        saved[k] = get()
                        setattr(torch.backends.cuda.matmul, f"allow_{k}_reduced_precision_reduction", False)
                if hasattr(torch._C, "_get_cublas_allow_fp16_accumulation"):
                    saved["acc"] = torch._C._get_cublas_allow_fp16_accumulation()
                    torch._C._set_cublas_allow_fp16_accumulation(False)
                _Fp32Reductions._saved = saved
            _Fp32Reductions._active += 1
        return self

    @classmethod
    def active(cls) -> bool:
        """Whether some thread is inside one now (cuBLAS reduces in float32 only)."""
        return cls._active > 0

    def __exit__(self, *exc):
        with self._lock:
            _Fp32Reductions._active -= 1
            if _Fp32Reductions._active == 0:
                saved = _Fp32Reductions._saved
                for k in ("bf16", "fp16"):
                    if k in saved:
                        v = saved[k]
                        setattr(torch.backends.cuda.matmul, f"allow_{k}_reduced_precision_reduction",
                                v if isinstance(v, bool) else tuple(v))
                if "acc" in saved:
                    torch._C._set_cublas_allow_fp16_accumulation(saved["acc"])
        return False


def _products_torch(dz, x, wc, dw_rows, dx_acc, accumulate: bool, on_call=None) -> None:
    """dw_rows = dz^T @ x (float32 accumulation, one rounding to dw_rows' dtype) and dx_acc (float32) = or +=
    dz @ wc, for dz (N, rows) and wc (rows, D); either output may be None. on_call: None, or called with the dz of
    each group of matmuls just before they run (the backward's record)."""
    with _Fp32Reductions():
        rows = dz.shape[1]
        main = rows // 8 * 8
        if rows != main and main and dz.stride(1) == 1 and dz.stride(0) % 8 == 0:
            # cuBLAS's products leave their fast path at a class count that is not a multiple of 8 (the last chunk
            # of an odd vocabulary, several times slower: docs/design/backward.md, "Odd vocabularies"): the
            # aligned classes, then the few left (dz's rows are 16-byte aligned: plans.dz_cols)
            _products_torch(dz[:, :main], x, wc[:main], None if dw_rows is None else dw_rows[:main], dx_acc,
                            accumulate, on_call)
            _products_torch(dz[:, main:], x, wc[main:], None if dw_rows is None else dw_rows[main:], dx_acc,
                            dx_acc is not None, on_call)
            return
        if on_call is not None:
            on_call(dz)
        if not x.is_cuda:  # the tests' stand-in: the same products in float32
            if dw_rows is not None:
                dw_rows.copy_(dz.t().float() @ x.float())
            if dx_acc is not None:
                torch.addmm(dx_acc, dz.float(), wc.float(), beta=1.0 if accumulate else 0.0, out=dx_acc)
            return
        # (float32 operands, only when a test forces this path on CUDA: the plain float32 products)
        to_f32 = dict(out_dtype=torch.float32) if dz.dtype != torch.float32 else {}
        if dw_rows is not None:
            torch.mm(dz.t(), x, out=dw_rows)
        if dx_acc is not None:
            if accumulate:
                torch.addmm(dx_acc, dz, wc, **to_f32, out=dx_acc)
            else:
                torch.mm(dz, wc, **to_f32, out=dx_acc)


# The products of a chunk and their cuBLAS settings under the names the two-head backward imports: both kernel
# families' gradient products are these.
MM_OUT_DTYPE = _MM_OUT_DTYPE
Fp32Reductions = _Fp32Reductions
products_torch = _products_torch
