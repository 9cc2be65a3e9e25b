"""What the benchmark measures: jobs, their phases, shape presets, and the inputs of one case.

A *case* is one (job, shape, dtype, data kind). Each job is timed in one or two *phases*:

  train     linear_cross_entropy(input, linear_weight, target), mean over tokens:
            "fwd+bwd" (forward then backward, split into fwd and bwd) and "no-grad" (the loss alone).
  logprobs  per-token log p(target) of a linear head: "no-grad" (scoring) and "fwd+bwd" (with gradients,
            upstream gradient a fixed random vector, as in RL fine-tuning).
  ce        cross_entropy on logits that already exist (N x V in the benchmark dtype), mean: "fwd+bwd".
  distill   linear_jsd(input, linear_weight, teacher_input, teacher_weight, beta=0.5), the symmetric JSD between a
            student head and a teacher head of the same shape, mean over tokens: "fwd+bwd" (gradients to the
            student). Opt-in (--job distill): not part of the default run.

The first phase of each job is its headline: the one the plots show and the progress bar names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import data

# The jobs that run when no --job is given, and those that run only when named.
JOBS = ("train", "logprobs", "ce")
OPT_IN_JOBS = ("distill",)
ALL_JOBS = JOBS + OPT_IN_JOBS
PHASES = {"train": ("fwd+bwd", "no-grad"), "logprobs": ("no-grad", "fwd+bwd"), "ce": ("fwd+bwd",),
          "distill": ("fwd+bwd",)}
# Which public op serves the job: the backend that "auto" picks for this op is "ours" in the ratios.
JOB_OP = {"train": "linear_cross_entropy", "logprobs": "linear_log_probs", "ce": "cross_entropy",
          "distill": "linear_jsd"}

# (N tokens, D hidden, V vocabulary) of real models' heads, at a typical tokens-per-step.
PRESETS: dict[str, tuple[int, int, int]] = {
    "gemma2-2b": (8192, 2304, 256000),
    "llama3-8b": (16384, 4096, 128256),
    "mistral-nemo": (8192, 5120, 131072),
    "qwen3-small": (16384, 1024, 151936),
    "gpt2": (8192, 768, 50257),
    # Small enough for a CPU; the float32 logits are still 65 MB, so the memory gap shows.
    "cpu-small": (512, 128, 32000),
    # Real data (--data real): Gemma 3 270M's head at its own D and lifted to gemma2-2b's and llama3-8b's D;
    # SmolLM2-135M's for a second vocabulary, and a CPU-sized cut of it.
    "gemma3-d640": (8192, 640, 262144),
    "gemma3-d2304": (8192, 2304, 262144),
    "gemma3-d4096": (16384, 4096, 262144),
    "smollm2-d576": (8192, 576, 49152),
    "smollm2-cpu": (512, 576, 49152),
}
# What runs when no shape is named: the targets of the kernel work on a GPU, one small shape on a CPU.
GPU_DEFAULT_PRESETS = {
    "train": ("gemma2-2b", "llama3-8b", "mistral-nemo", "qwen3-small"),
    "logprobs": ("gemma2-2b", "llama3-8b"),
    "ce": ("llama3-8b", "gemma2-2b"),  # N x V = 16384 x 128256 and 8192 x 256000
    "distill": ("gemma2-2b",),  # student and teacher (8192, 2304) over 256000 classes
}
CPU_DEFAULT_PRESETS = {job: ("cpu-small",) for job in ALL_JOBS}
# Real data has the model's vocabulary: its cases use these shapes when none is named.
REAL_GPU_PRESETS = ("gemma3-d640", "gemma3-d2304", "gemma3-d4096")
REAL_CPU_PRESETS = ("smollm2-cpu",)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    name: str  # preset name, or "N,D,V" for a custom shape
    N: int
    D: int
    V: int


@dataclass(frozen=True)
class Case:
    job: str
    shape: Shape
    dtype: str  # a key of DTYPES
    data: str  # a key of data.KINDS

    @property
    def label(self) -> str:
        return f"{self.job} {self.shape.name} (N={self.shape.N}, D={self.shape.D}, V={self.shape.V}) " \
               f"{self.dtype} data={self.data}"


def parse_shape(text: str) -> Shape:
    """A preset name or "N,D,V" (positive integers) -> Shape; ValueError naming the problem otherwise."""
    text = text.strip()
    if text in PRESETS:
        return Shape(text, *PRESETS[text])
    parts = text.replace("x", ",").split(",")
    if len(parts) != 3:
        raise ValueError(f"shape {text!r} is neither a preset ({', '.join(PRESETS)}) nor N,D,V")
    try:
        n, d, v = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape {text!r}: N, D and V must be integers") from None
    if min(n, d, v) < 1:
        raise ValueError(f"shape {text!r}: N, D and V must be positive")
    return Shape(f"{n},{d},{v}", n, d, v)


def flops(job: str, phase: str, s: Shape) -> float:
    """Matrix-product FLOPs the phase needs at least: 2NDV per product (logits; dinput and dweight in backward).
    distill: both heads' logits, then the student's two gradient products."""
    if job == "ce":
        return 0.0
    if job == "distill":
        return (8.0 if phase == "fwd+bwd" else 4.0) * s.N * s.D * s.V
    return (6.0 if phase == "fwd+bwd" else 2.0) * s.N * s.D * s.V


def min_bytes(job: str, phase: str, s: Shape, dtype: str) -> float:
    """Bytes ce must move at least: read the logits once, write their gradient once."""
    if job != "ce":
        return 0.0
    return 2.0 * s.N * s.V * torch.empty((), dtype=DTYPES[dtype]).element_size()


class Heads:
    """Heads built once per (data kind, shape, dtype) and shared by the jobs that use them."""

    def __init__(self, device: torch.device, seed: int, data_file=None, cache_dir=None):
        self.device, self.seed = device, seed
        self.real = {"data_file": data_file, "cache_dir": cache_dir}  # where --data real reads its head
        self._cache: dict[tuple, data.Head] = {}

    def get(self, kind: str, s: Shape, dtype: str) -> data.Head:
        key = (kind, s.N, s.D, s.V, dtype)
        if key not in self._cache:
            self._cache.clear()  # one head alive at a time: the large shapes are gigabytes
            extra = self.real if kind in data.REAL_KINDS else {}
            self._cache[key] = data.make_head(kind, s.N, s.D, s.V, dtype=DTYPES[dtype], device=self.device,
                                              seed=self.seed, **extra)
        return self._cache[key]


@dataclass
class Inputs:
    """The tensors of one case, allocated before anything is measured (so they count as inputs)."""

    x: torch.Tensor | None  # (N, D)          train, logprobs
    w: torch.Tensor | None  # (V, D)          train, logprobs
    t: torch.Tensor  # (N,) int64
    upstream: torch.Tensor | None  # (N,) float32: d(objective)/d(logp), logprobs only
    logits: torch.Tensor | None  # (N, V)     ce: the working buffer (in-place providers overwrite it)
    pristine: torch.Tensor | None  # (N, V)   ce: the logits as generated, restored before every run
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None  # distill: (teacher input (N, D), weight (V, D))

    def tensors(self):
        return [a for a in (self.x, self.w, self.t, self.upstream, self.logits, self.pristine, *(self.teacher or ()))
                if a is not None]


# One teacher at a time, for the head it was made from (the check slice and the full batch share it).
_TEACHER: dict = {}


def teacher_for(head: data.Head, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher head related to the student's: the same hidden states and the student's weight plus Gaussian
    noise of half its scale, so that both softmaxes are of the data kind's shape and differ (JSD ~0.1-0.3 nats)."""
    key = (id(head.weight), head.weight.shape, seed)
    if key not in _TEACHER:
        _TEACHER.clear()
        w = head.weight
        g = torch.Generator(device=w.device).manual_seed(seed + 2)
        noise = torch.randn(w.shape, device=w.device, generator=g, dtype=torch.float32)
        scale = 0.5 * w.float().std()
        _TEACHER[key] = (head.input, (w.float() + scale * noise).to(w.dtype))
    return _TEACHER[key]


def make_inputs(job: str, head: data.Head, rows: slice | None = None, seed: int = 0) -> Inputs:
    x, w, t = head.input, head.weight, head.target
    if rows is not None:
        x, t = x[rows], t[rows]
    upstream = None
    if job == "logprobs":
        g = torch.Generator(device=x.device).manual_seed(seed + 1)
        upstream = torch.randn(x.shape[0], device=x.device, generator=g)
    if job == "ce":
        logits = x @ w.T  # the head's logits in the benchmark dtype, as a model would hand them over
        return Inputs(None, None, t, None, logits, logits.clone())
    teacher = None
    if job == "distill":
        xt, wt = teacher_for(head, seed)
        teacher = (xt if rows is None else xt[rows], wt)
    return Inputs(x, w, t, upstream, None, None, teacher)


def mib(nbytes: float) -> float:
    return nbytes / 2**20 if nbytes == nbytes else math.nan


def split_values(values) -> list[str]:
    """The comma-separated values of a repeatable command-line option (`--dtype bf16,fp16 --dtype fp32`), in order."""
    out = []
    for v in values or []:
        out += [p.strip() for p in v.split(",") if p.strip()]
    return out
