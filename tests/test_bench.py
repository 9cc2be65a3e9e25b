"""`logitless bench` on the CPU: arguments, the files of a tiny run, the correctness gate, the memory measure."""

import csv
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
import torch

from logitless import testing
from logitless.apps import cli as top_cli
from logitless.apps.bench import cases, check, measure, providers, svg
from logitless.apps.bench import cli as bench_cli
from logitless.apps.bench.providers import Provider, Step

TINY = ["--shape", "40,16,300", "--no-progress", "--budget", "0.01", "--min-reps", "1", "--max-reps", "2"]
FAST = "logitless-torch,torch-eager,floor"
SVG = "{http://www.w3.org/2000/svg}"


def _resolve(argv):
    parser = bench_cli.build_parser()
    return bench_cli.resolve(parser.parse_args(argv), parser)


def test_defaults_on_cpu():
    cs, ps, opts = _resolve(["--device", "cpu"])
    assert {c.job for c in cs} == set(cases.JOBS)
    assert {(c.shape.name, c.dtype, c.data) for c in cs} == {("cpu-small", "fp32", "lm")}
    # the slow ones on a CPU (compile, chunked torch, Triton peers) only when asked for
    assert [p.name for p in ps] == ["logitless-torch", "torch-eager", "floor"]
    assert opts.check_rows == 256 and opts.device.type == "cpu"


def test_shapes_presets_and_lists():
    cs, ps, opts = _resolve(["--device", "cpu", "--job", "train,ce", "--preset", "gpt2", "--shape", "7,5,3",
                             "--shape", "8x4x2", "--dtype", "bf16", "--dtype", "fp16", "--data", "lm,uniform",
                             "--providers", "torch-eager,floor,liger", "--exclude", "liger", "--check-rows", "9"])
    shapes = {(c.shape.N, c.shape.D, c.shape.V) for c in cs}
    assert shapes == {(8192, 768, 50257), (7, 5, 3), (8, 4, 2)}
    assert len(cs) == 2 * 3 * 2 * 2  # jobs x shapes x dtypes x data kinds
    assert [p.name for p in ps] == ["torch-eager", "floor"]
    assert opts.check_rows == 9


@pytest.mark.parametrize("argv", [
    ["--job", "nope"], ["--shape", "1,2"], ["--shape", "1,0,3"], ["--shape", "a,b,c"], ["--preset", "gpt5"],
    ["--dtype", "fp8"], ["--data", "zipf"], ["--providers", "nobody"], ["--exclude", "nobody"],
    ["--min-reps", "5", "--max-reps", "2"], ["--budget", "0"], ["--check-rows", "0"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _resolve(["--device", "cpu", *argv])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        top_cli.main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for action in bench_cli.build_parser()._actions:
        for opt in action.option_strings:
            assert opt in text
        assert action.help, f"{action.option_strings} has no help text"
    for name in [p.name for p in providers.REGISTRY] + list(cases.PRESETS):
        assert name in text


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "logitless.apps.bench", "--list", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch-eager" in out.stdout and "floor" in out.stdout


def test_tiny_run_writes_table_json_csv_svg(tmp_path, capsys):
    out = tmp_path / "out"
    assert bench_cli.main([*TINY, "--providers", FAST, "--data", "lm,uniform", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("table.txt", "table.md", "results.json", "results.csv", "bench_train.svg", "bench_logprobs.svg",
                 "bench_ce.svg"):
        assert (out / name).stat().st_size > 0, name
    # The plot: one row of two panels per data kind, a bar per provider (the floor a dashed line), a legend.
    root = ET.fromstring((out / "bench_train.svg").read_text())
    texts = [t.text for t in root.iter(SVG + "text")]
    assert texts.count("train, fp32, data=lm") == 2 and texts.count("train, fp32, data=uniform") == 2
    assert texts.count("40,16,300") == 4 and {"logitless-torch", "torch-eager", "dense floor"} <= set(texts)
    bars = [r.find(SVG + "title").text for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert len(bars) == 2 * 2 * 2 and not any(b.startswith("floor") for b in bars)
    assert len([x for x in root.iter(SVG + "line") if x.get("stroke-dasharray")]) == 2 + 1  # per time panel, legend
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["data"]) == {"lm", "uniform"}
    assert doc["meta"]["torch"] == torch.__version__
    recs = doc["results"]
    # 3 jobs x 2 data kinds x 3 providers, with 2 + 2 + 1 phases per job
    assert len(recs) == 2 * 3 * (2 + 2 + 1)
    for r in recs:
        assert r["status"] == "ok" and r["phase_status"] == "ok", r
        assert r["median_ms"] > 0 and r["reps"] >= 1
        if r["provider"] == "floor":
            assert r["x_floor"] == pytest.approx(1.0)
        if r["provider"] == "logitless-torch":
            assert r["x_ours"] == pytest.approx(1.0)
            assert r["peak_mib"] >= 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == len(recs) and set(rows[0]) == set(report_fields())
    table = (out / "table.txt").read_text()
    assert "train 40,16,300 (N=40, D=16, V=300) fp32 data=lm" in table
    assert "data lm:" in table and "data uniform:" in table
    assert "torch-eager" in printed and "x floor" in printed


def report_fields():
    from logitless.apps.bench import report

    return report.CSV_FIELDS


def _wrong_loss(x, w, t):
    return 1.5 * testing.naive_linear_cross_entropy(x, w, t)


def _raises(x, w, t):
    raise RuntimeError("deliberately broken")


def test_failing_provider_is_reported_and_not_timed(tmp_path, monkeypatch):
    timed = []
    real_time_step = measure.time_step

    def spy(step, *a, **kw):
        timed.append(step)
        return real_time_step(step, *a, **kw)

    monkeypatch.setattr("logitless.apps.bench.runner.time_step", spy)
    wrong = Provider("wrong", "loss scaled by 1.5", {"train": lambda: _wrong_loss})
    broken = Provider("broken", "raises", {"train": lambda: _raises})
    monkeypatch.setattr(providers, "REGISTRY", [*providers.REGISTRY, wrong, broken])
    out = tmp_path / "out"
    argv = [*TINY, "--job", "train", "--providers", "torch-eager,wrong,broken", "--out", str(out), "--no-plots"]
    assert bench_cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    by = {}
    for r in doc["results"]:
        by.setdefault(r["provider"], []).append(r)
    assert {r["status"] for r in by["wrong"]} == {"failed check"}
    assert all(r["median_ms"] is None and r["phase_status"] == "not timed" for r in by["wrong"])
    assert "loss" in by["wrong"][0]["error"] and "PyTorch" in by["wrong"][0]["error"]
    assert {r["status"] for r in by["broken"]} == {"error"}
    assert "deliberately broken" in by["broken"][0]["error"]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in by["torch-eager"])
    assert len(timed) == 2  # the eager provider's two phases, nothing of the failing ones
    checks = {c["provider"]: c["comparisons"] for c in doc["checks"]}
    assert not next(c for c in checks["wrong"] if c["name"] == "loss")["ok"]
    assert all(c["ok"] for c in checks["torch-eager"])
    assert "FAIL" in (out / "table.txt").read_text()


def test_time_failing_times_them_anyway(tmp_path, monkeypatch):
    wrong = Provider("wrong", "loss scaled by 1.5", {"train": lambda: _wrong_loss})
    monkeypatch.setattr(providers, "REGISTRY", [*providers.REGISTRY, wrong])
    out = tmp_path / "out"
    argv = [*TINY, "--job", "train", "--providers", "wrong", "--out", str(out), "--no-plots", "--time-failing"]
    assert bench_cli.main(argv) == 0
    recs = json.loads((out / "results.json").read_text())["results"]
    assert all(r["status"] == "failed check" and r["median_ms"] > 0 for r in recs)


def test_rel_err_and_the_two_times_rule():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, 7, generator=g), torch.randn(50, 7, generator=g)
    assert check.rel_err(a, a) == 0.0
    assert abs(check.rel_err(a, b) - ((a.double() - b.double()).norm() / b.double().norm()).item()) < 1e-12
    assert check.rel_err(torch.full_like(a, float("nan")), b) == float("inf")
    assert check.rel_err(torch.full_like(a, float("nan")), torch.full_like(b, float("nan"))) == 0.0
    ok = check.Comparison("loss", err=2e-3, err_torch=1e-3)
    bad = check.Comparison("loss", err=2.1e-3, err_torch=1e-3)
    assert ok.ok and not bad.ok


def test_cpu_peak_memory_counts_temporaries_not_outputs():
    # A 40 MB temporary freed inside the run, a 4 MB output kept: the peak above inputs and outputs is 40 MB.
    def fwd():
        tmp = torch.ones(10_000_000)
        out = torch.empty(1_000_000).copy_(tmp[:1_000_000])
        del tmp
        return out

    x = torch.ones(1000)
    peak = measure.peak_extra_bytes(Step(fwd, None), lambda: None, torch.device("cpu"), [x], [])
    assert 40e6 <= peak <= 40e6 + 1e5


@pytest.mark.slow  # a real-size CPU run; the tiny runs above cover the measuring and the files
def test_memory_gap_shows_on_the_cpu(tmp_path):
    # At the CPU preset's N and V, what the library is for must show: eager builds the logits, the chunked path
    # does not. (D is smaller than the preset's to keep the test fast; it does not change the logits' size.)
    out = tmp_path / "out"
    n, v = cases.PRESETS["cpu-small"][0], cases.PRESETS["cpu-small"][2]
    argv = ["--job", "train", "--shape", f"{n},16,{v}", "--providers", "logitless-torch,torch-eager",
            "--no-progress", "--budget", "0.01", "--min-reps", "1", "--max-reps", "1", "--out", str(out),
            "--no-plots"]
    assert bench_cli.main(argv) == 0
    recs = json.loads((out / "results.json").read_text())["results"]
    peak = {(r["job"], r["phase"], r["provider"]): r["peak_mib"] for r in recs}
    logits_mib = n * v * 4 / 2**20
    assert peak[("train", "fwd+bwd", "torch-eager")] > 2 * logits_mib
    assert peak[("train", "fwd+bwd", "logitless-torch")] < 0.5 * logits_mib
    assert peak[("train", "no-grad", "torch-eager")] > logits_mib


def test_plots_need_no_plotting_library(tmp_path, monkeypatch):
    # `pip install -e .` has no matplotlib: the base install draws the plots all the same.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out"
    assert bench_cli.main([*TINY, "--job", "ce", "--providers", "torch-eager,floor", "--out", str(out)]) == 0
    assert ET.fromstring((out / "bench_ce.svg").read_text()).tag == SVG + "svg"


def test_svg_axes_ticks_and_missing_bars():
    # Log ticks cover the range in 1-2-5 steps; a bar with no value (a failed provider) is left out, not drawn at 0.
    assert [s for _, s in svg.ticks(0.03, 2.0, log=True)] == ["0.05", "0.1", "0.2", "0.5", "1", "2"]
    assert [s for _, s in svg.ticks(0.003, 400.0, log=True)] == ["0.01", "0.1", "1", "10", "100"]
    assert [s for _, s in svg.ticks(0.0, 546.0, log=False)] == ["0", "100", "200", "300", "400", "500"]
    p = svg.Panel("t <&>", "ms", ["a", "b"], {"p": [3.0, None], "q": [None, None]}, [1.0, None], log=True)
    root = ET.fromstring(svg.figure([[p]], {"p": "#000000", "q": "#111111"}, "floor"))
    assert [r.find(SVG + "title").text for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None] == [
        "p, a: 3"]
    assert "t <&>" in [t.text for t in root.iter(SVG + "text")]


@pytest.mark.gpu
def test_event_ms_and_peak_extra_mib():
    # The scripts' building blocks: a temporary allocation counts, a returned one does not.
    ms, out = measure.event_ms(lambda: torch.ones(1 << 20, device="cuda").sum())
    assert ms > 0 and out.item() == 1 << 20
    assert measure.peak_extra_mib(lambda: torch.ones(1 << 20, device="cuda").sum()) >= 4.0
    assert abs(measure.peak_extra_mib(lambda: torch.empty(1 << 20, device="cuda"))) < 0.01


def _sleepy_step(times):
    # A step whose n-th run sleeps times[n] seconds (the last value from then on); counts its runs.
    calls = []

    def fwd():
        time.sleep(times[min(len(calls), len(times) - 1)])
        calls.append(1)

    return Step(fwd, None), calls


@pytest.mark.parametrize("times, warmup, raises, runs", [
    ([0.25, 0.0], 1, False, 2),  # the first run compiles: slow but under 10 x the limit; the second is fast
    ([0.0, 0.25, 0.0], 2, False, 3),  # the second compiles (the default's probe of skipping): a third follows
    ([0.25, 0.25, 0.25], 1, True, 3),  # slow every time: too slow at the third run
    ([0.0, 0.0, 0.25], 3, True, 3),  # slow after the compiling runs
    ([1.5], 1, True, 1),  # the first run alone is over 10 x the limit
    ([0.0, 1.5], 2, True, 2),  # so is the second
    ([0.0], 1, False, 1),  # fast: one warm-up run, as asked
])
def test_warm_up_gives_the_first_runs_a_compile_allowance(times, warmup, raises, runs):
    step, calls = _sleepy_step(times)
    if raises:
        with pytest.raises(measure.TooSlow):
            measure.warm_up(step, lambda: None, torch.device("cpu"), warmup, 0.1)
    else:
        assert measure.warm_up(step, lambda: None, torch.device("cpu"), warmup, 0.1) < 0.1
    assert len(calls) == runs


def _name_columns(lines, names):
    """The column at which the text after each provider's name starts, asserting a space separates the two."""
    cols = set()
    for name in names:
        found = [ln for ln in lines if ln.startswith(f"  {name} ")]
        assert len(found) == 1, f"no line of {name} alone: {[ln for ln in lines if name in ln]}"
        line = found[0]
        cols.add(len(line) - len(line[len(name) + 2:].lstrip(" ")))
    return cols


def test_help_and_list_align_the_longest_provider_name(capsys):
    # logitless-triton-ws is 19 characters: a fixed 18-wide column ran it into its description.
    names = [p.name for p in providers.REGISTRY]
    assert max(map(len, names)) >= 19
    help_lines = bench_cli.build_parser().format_help().splitlines()
    assert len(_name_columns(help_lines, names)) == 1
    assert bench_cli.main(["--list", "--device", "cpu"]) == 0
    assert len(_name_columns(capsys.readouterr().out.splitlines(), names)) == 1


@pytest.mark.parametrize("argv, emptied", [
    (["--exclude", FAST], "train, logprobs, ce"),  # every default CPU provider
    (["--job", "train,ce", "--providers", "torch-lce,floor", "--exclude", "floor"], "ce"),  # torch-lce has no ce
])
def test_exclude_that_leaves_a_job_no_provider_exits_2(argv, emptied, capsys):
    with pytest.raises(SystemExit) as e:
        _resolve(["--device", "cpu", *argv])
    assert e.value.code == 2
    assert f"--exclude leaves no provider for job(s) {emptied}\n" in capsys.readouterr().err


def test_providers_alone_pick_the_jobs_they_run():
    cases, chosen, _ = _resolve(["--device", "cpu", "--providers", "liger", "--shape", "64,32,100"])
    assert [p.name for p in chosen] == ["liger"]
    assert sorted({c.job for c in cases}) == sorted(providers.by_name()["liger"].jobs)


@pytest.mark.parametrize("argv, unserved", [
    (["--job", "logprobs", "--providers", "liger"], ["logprobs"]),  # liger has no log-probs
    (["--job", "train,ce", "--providers", "torch-lce"], ["ce"]),
])
def test_providers_that_run_no_case_of_a_job_exit_2(argv, unserved, capsys):
    # Before, the run went ahead and printed an empty table for the job.
    with pytest.raises(SystemExit) as e:
        _resolve(["--device", "cpu", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--providers names no provider for job(s) " in err
    for job in unserved:
        runners = [p.name for p in providers.REGISTRY if job in p.jobs]
        assert f"{job} (run by {', '.join(runners)})" in err


def test_output_files_are_replaced_together_or_not_at_all(tmp_path, monkeypatch, capsys):
    # The files of a run appear only when all are written: a failure while writing them (here the CSV) leaves the
    # previous run's files byte for byte, and no temporary file behind.
    from logitless.apps.bench import report

    out = tmp_path / "out"
    argv = [*TINY, "--job", "ce", "--providers", "floor", "--no-plots", "--out", str(out)]
    assert bench_cli.main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"table.txt", "table.md", "results.json", "results.csv"}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(report, "write_csv", broken)
    with pytest.raises(OSError, match="disk full"):
        bench_cli.main([*argv, "--seed", "1"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()
    assert bench_cli.main([*argv, "--seed", "1"]) == 0
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(after) == set(before) and after["results.json"] != before["results.json"]
    # --out naming a file is refused before anything runs.
    with pytest.raises(SystemExit) as e:
        bench_cli.main([*TINY, "--out", str(out / "table.txt")])
    assert e.value.code == 2 and "is not a folder" in capsys.readouterr().err


def test_no_clobber_and_the_mark_of_gradients_taken_in_the_forward(tmp_path, capsys):
    # The PyTorch path's fused training path computes the gradients in its forward: its fwd+bwd split is marked,
    # and the table says why its "bwd" is tiny. --no-clobber refuses an --out that holds a run's files.
    from logitless.apps.bench import report

    out = tmp_path / "out"
    argv = [*TINY, "--job", "train", "--providers", "logitless-torch,torch-eager", "--no-plots", "--no-clobber",
            "--out", str(out)]
    assert bench_cli.main(argv) == 0
    table = (out / "table.txt").read_text()
    assert report.FOLDED_NOTE in table
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] in (["logitless-torch"],
                                                                                                 ["torch-eager"])}
    assert rows["logitless-torch"][4].endswith("*") and rows["logitless-torch"][5].endswith("*")
    assert not rows["torch-eager"][4].endswith("*")
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as e:
        bench_cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "already holds table.txt" in err and "--no-clobber" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_skipped_cell_says_when_the_gate_ran_dense():
    # The default's gate keeps the share of its last probe when it finds too little cold and runs the dense plans:
    # the table must not read that share as what the timed calls skipped.
    from logitless.apps.bench import report, runner

    case = cases.Case("train", cases.parse_shape("40,16,300"), "bf16", "uniform")
    rows = {}
    for state in ("skip", "dense", ""):
        pr = runner.PhaseResult("fwd+bwd", "ok", total_ms=1.0, fwd_ms=0.5, bwd_ms=0.5, skipped=0.31, skip_state=state)
        r = runner.Result(case, "logitless-triton", "ok", phases={"fwd+bwd": pr})
        rows[state] = report._row(r, "fwd+bwd", True)[-1]
        assert list(report._records(runner.Run([r], {}, {}, {}, {})))[0]["skip_state"] == state
    assert rows == {"skip": "31%", "dense": "31% (dense)", "": "31%"}
    assert "skip_state" in report.CSV_FIELDS
