"""Benchmark data: the skip statistics, real-head files (write, split, join, load, lift), `--data real` in the
bench, and the `lm` generator's figures against those measured on a real model."""

import math
import os

import pytest
import torch

import logitless
from logitless import testing
from logitless.apps.bench import cli as bench_cli
from logitless.apps.bench import data, real
from tests.helpers import check_against_truth


def _brute_stats(z, target, rows, cols, thresholds):
    # The definitions of skip_stats, written out on the whole float64 softmax (small sizes only).
    p = torch.softmax(z.double(), -1)
    nb = z.shape[0] // rows
    p = p[:nb * rows]
    out = {"entropy": float(-(p * torch.log_softmax(z.double()[:nb * rows], -1)).sum(-1).mean()),
           "loss": float(-torch.log_softmax(z.double()[:nb * rows], -1).gather(1, target[:nb * rows, None]).mean())}
    V = z.shape[1]
    T = math.ceil(V / cols)
    for name, order in (("identity", torch.arange(V)), ("sorted", torch.argsort(p.sum(0), descending=True))):
        q = p[:, order]
        cold, skip = 0, [0] * len(thresholds)
        for b in range(nb):
            m = torch.stack([q[b * rows:(b + 1) * rows, c * cols:(c + 1) * cols].sum(1) for c in range(T)], 1)
            cold += sum(bool((m[:, c] <= thresholds[0]).all()) for c in range(T))
            tiles = sorted(range(T), key=lambda c: float(m[:, c].max()))
            for k, t in enumerate(thresholds):
                run = torch.zeros(rows, dtype=torch.float64)
                for c in tiles:
                    run = run + m[:, c]
                    if bool((run > t).any()):
                        break
                    skip[k] += 1
        out[name] = {"cold": cold / (nb * T), "skip": [s / (nb * T) for s in skip]}
    return out


def test_skip_stats_by_hand():
    # Logits = x @ I: each row puts its mass on one class, and 2^-10 of it on the second tile (rows 0-1) or on
    # the tile of its hot class (rows 2-3). Identity order, 2 tiles of 4 classes, one block of 4 rows.
    V = 8
    z = torch.full((4, V), 0.0, dtype=torch.float64)
    z[0, 0] = z[1, 0] = z[2, 4] = z[3, 4] = 30.0
    z[0, 4:] = z[1, 4:] = z[2, :4] = z[3, :4] = 30.0 + math.log(2**-10 / 4)  # each row: 2^-10 off its hot tile
    s = data.skip_stats(z.float(), torch.eye(V), torch.zeros(4, dtype=torch.long), rows=4, cols=4)
    # Both tiles are hot for some row: nothing is cold, and nothing can be skipped at any threshold.
    assert s["identity"]["cold"] == 0 and s["identity"]["skip"] == [0, 0, 0]
    y = torch.zeros(2, V, dtype=torch.float64)
    y[:, 0], y[:, 4] = 30.0, 30.0 + math.log(2**-10)
    s = data.skip_stats(y.float(), torch.eye(V), torch.zeros(2, dtype=torch.long), rows=2, cols=4)
    # Two rows with 2^-10 of their mass on class 4: in identity order the second tile holds it (not cold,
    # skippable at 2^-8 and 2^-6 only); sorted by mass, classes 0 and 4 share the first tile and the second is cold.
    assert s["identity"]["cold"] == 0 and s["identity"]["skip"] == [0, 0.5, 0.5]
    assert s["sorted"]["cold"] == 0.5 and s["sorted"]["skip"] == [0.5, 0.5, 0.5]
    assert s["entropy"] > 0 and abs(s["loss"]) < 1e-3


@pytest.mark.parametrize("N,V,rows,cols", [(37, 300, 8, 32), (64, 257, 16, 64)])
def test_skip_stats_matches_the_definitions(N, V, rows, cols):
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, 16, generator=g) * 3
    w = torch.randn(V, 16, generator=g) + torch.linspace(-4, 2, V)[:, None] * torch.randn(16, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    th = (2.0**-12, 2.0**-8, 2.0**-6)
    got = data.skip_stats(x, w, t, rows=rows, cols=cols, thresholds=th)
    want = _brute_stats(x.double() @ w.double().T, t, rows, cols, th)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4) and got["entropy"] == pytest.approx(want["entropy"],
                                                                                                   rel=1e-4)
    for order in ("identity", "sorted"):
        assert got[order]["cold"] == pytest.approx(want[order]["cold"])
        assert got[order]["skip"] == pytest.approx(want[order]["skip"])
    assert 0 < want["sorted"]["skip"][2] < 1  # the data exercise both outcomes


def test_skip_stats_needs_a_block():
    with pytest.raises(ValueError, match="rows = 128"):
        data.skip_stats(torch.randn(5, 4), torch.randn(9, 4))


def _fake_real(V=96, D=64, N=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": "test", "V": V, "D": D, "text": "random numbers",
            "weight_q8": torch.randint(-127, 128, (V, D), generator=g, dtype=torch.int8),
            "weight_scale": (torch.rand(V, D // 32, generator=g) * 0.01 + 1e-3).half(),
            "input": torch.randn(N, D, generator=g) * 20, "target": torch.randint(0, V, (N,), generator=g)}


def test_real_file_write_split_join_load(tmp_path):
    obj = _fake_real()
    path = real.write(tmp_path / "head.pt", obj)
    whole = real.load(path)
    # Q8_0 dequantises exactly: the int8 times its block's float16 scale, in float32.
    want = (obj["weight_q8"].double().view(96, 2, 32) * obj["weight_scale"].double()[..., None]).view(96, 64)
    assert torch.equal(whole["weight"].double(), want)
    assert torch.equal(whole["input"], obj["input"]) and torch.equal(whole["target"], obj["target"])
    parts = real.split_file(path, part_mib=0.004)
    assert len(parts) > 2 and all(p.stat().st_size <= 0.004 * 2**20 for p in parts)
    folder = tmp_path / "parts"
    folder.mkdir()
    for p in parts:
        p.rename(folder / p.name)
    path.unlink()
    for source in (folder, tmp_path / "parts" / "head.pt"):  # a folder of parts, or the name the parts share
        got = real.load(source)
        assert torch.equal(got["weight"], whole["weight"]) and torch.equal(got["input"], whole["input"])
    (folder / "head.pt.part01").unlink()
    with pytest.raises(ValueError, match="part missing"):
        real.load(folder)
    with pytest.raises(FileNotFoundError, match="nor"):
        real.load(tmp_path / "nothing.pt")
    torch.save({"a": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a logitless real-head file"):
        real.load(tmp_path / "other.pt")


def test_lift_keeps_the_logits():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 64, generator=g) * 10, torch.randn(50, 64, generator=g)
    x2, w2 = real.lift(x, w, 96, seed=3, dtype=torch.float32, chunk=7)
    assert x2.shape == (20, 96) and w2.shape == (50, 96)
    z, z2 = x.double() @ w.double().T, x2.double() @ w2.double().T
    assert (z2 - z).abs().max() <= 1e-5 * z.abs().max()
    assert (x2[:, 64:] != 0).any()  # the lifted vectors use the new dimensions
    with pytest.raises(ValueError, match="at least 64"):
        real.lift(x, w, 32)


def test_real_serves_only_its_vocabulary():
    assert real.serves(262144, 640, 16384, 8192, 2304, 262144) is None
    assert "vocabulary" in real.serves(262144, 640, 16384, 8192, 640, 256000)
    assert "lifted" in real.serves(262144, 640, 16384, 8192, 512, 262144)
    assert "tokens" in real.serves(262144, 640, 16384, 32768, 640, 262144)
    assert real.model_for(49152) == "smollm2-135m"
    with pytest.raises(ValueError, match="262144"):
        real.model_for(50257)


def _resolve(argv):
    parser = bench_cli.build_parser()
    return bench_cli.resolve(parser.parse_args(argv), parser)


def test_bench_real_shapes(capsys):
    cs, _, _ = _resolve(["--device", "cpu", "--data", "real", "--job", "train"])
    assert [(c.shape.name, c.data) for c in cs] == [("smollm2-cpu", "real")]
    cs, _, opts = _resolve(["--device", "cpu", "--data", "real,lm", "--job", "train", "--preset", "gemma3-d2304",
                            "--shape", "64,128,32000"])
    assert {(c.shape.name, c.data) for c in cs} == {("gemma3-d2304", "real"), ("gemma3-d2304", "lm"),
                                                   ("64,128,32000", "lm")}
    assert len(opts.skipped) == 1 and "V = 32000" in opts.skipped[0]
    with pytest.raises(SystemExit) as e:
        _resolve(["--device", "cpu", "--data", "real", "--shape", "64,128,32000"])
    assert e.value.code == 2 and "no case left" in capsys.readouterr().err


def test_bench_runs_on_a_data_file(tmp_path, capsys):
    path = real.write(tmp_path / "head.pt", _fake_real(V=96, D=64, N=40))
    real.split_file(path, part_mib=0.004)
    path.unlink()
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--data-file", str(path), "--job", "train", "--shape", "32,80,96", "--shape",
            "64,80,96", "--shape", "32,48,96", "--providers", "logitless-torch,torch-eager,floor", "--no-progress",
            "--budget", "0.01", "--min-reps", "1", "--max-reps", "2", "--no-plots", "--out", str(out)]
    assert bench_cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "skipped train 32,48,96 data=real" in text  # D below the file's 64
    assert "data real: test head (V = 96, D = 64, lifted to D = 80" in text
    assert "train 32,80,96 (N=32, D=80, V=96) fp32 data=real" in text
    assert "skipped train 64,80,96 data=real: real data has 40 tokens, fewer than N = 64" in text
    assert "train 32,80,96" in (out / "table.txt").read_text()
    data._loaded.clear()


def test_real_sorted_is_the_same_problem_in_mass_order(tmp_path):
    """--data real-sorted: the head's rows and the targets permuted together (same losses), classes in decreasing
    mass over the tokens left out of the batch."""
    path = real.write(tmp_path / "head.pt", _fake_real(V=96, D=64, N=40))
    plain = data.make_head("real", 16, 64, 96, dtype=torch.float32, data_file=path)
    srt = data.make_head("real-sorted", 16, 64, 96, dtype=torch.float32, data_file=path)
    assert "sorted by softmax mass over held-out tokens" in srt.description
    ce = lambda h: torch.nn.functional.cross_entropy(h.input @ h.weight.T, h.target, reduction="none")
    torch.testing.assert_close(ce(srt), ce(plain), rtol=1e-5, atol=1e-5)
    src = real.load(path)
    held = src["input"][16:].float()
    p = torch.softmax(held @ srt.weight.float().T, dim=1).sum(0)
    assert torch.all(p[:-1] >= p[1:] - 1e-4)  # decreasing mass over the held-out rows
    # With too few tokens left out, the batch's own mass orders the classes (and the description says so).
    srt_all = data.make_head("real-sorted", 40, 64, 96, dtype=torch.float32, data_file=path)
    assert "the batch itself" in srt_all.description
    data._loaded.clear()


# Gemma 3 270M's head with its hidden states on the standard-library text (python -m logitless.apps.bench.real),
# N = 256 tokens at 4 places of the 16384 (0, 4096, 8192, 12288), 128 x 256 pairs: the smallest and largest
# figure in percent, per order: cold, skip at 2^-12, 2^-8, 2^-6; entropy and loss in nats.
REAL_256 = {
    "identity": [(36.0, 42.8), (7.2, 9.3), (19.0, 26.0), (37.6, 44.2)],
    "sorted": [(85.4, 91.7), (41.6, 52.3), (74.8, 84.1), (84.8, 92.8)],
    "entropy": (2.16, 2.90), "loss": (2.13, 3.33),
}
# The generator misses one figure by more than a few points: in identity order its single tiles are cold in
# about 25% of the pairs, the real head's in 36-43% (docs/data.md).
GAP = {("identity", 0): 20.0}


@pytest.mark.slow  # the calibration at the real head's size; the generator's own tests stay in the quick run
def test_lm_generator_matches_the_real_head():
    s = data.skip_stats(*data.lm_like(256, 128, 262144, dtype=torch.float32, seed=1, calib_rows=32)[:3])
    for order in ("identity", "sorted"):
        figs = [s[order]["cold"]] + s[order]["skip"]
        for k, (v, (lo, hi)) in enumerate(zip(figs, REAL_256[order], strict=True)):
            margin = GAP.get((order, k), 6.0)
            assert lo - margin <= 100 * v <= hi + margin, (order, k, 100 * v, (lo, hi))
    for key in ("entropy", "loss"):
        lo, hi = REAL_256[key]
        assert lo - 0.3 <= s[key] <= hi + 0.3, (key, s[key])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [640, 2304])
def test_gpu_real_head_within_the_rule(D):
    # The fused head on Gemma 3 270M's real head, at its own D and lifted: loss and gradients within the rule.
    path = os.environ.get("LOGITLESS_REAL_DATA")
    if not path:
        pytest.skip("LOGITLESS_REAL_DATA names no prepared real-head file (or folder of its parts)")
    head = data.make_head("real", 1024, D, 262144, data_file=path, device="cuda")
    check_against_truth(logitless.linear_cross_entropy, testing.naive_linear_cross_entropy, head.input,
                        head.weight, None, head.target, backend="triton")
